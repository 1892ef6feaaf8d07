"""One writer per checkpoint directory (issue #29 case 1, ADR 0024).

Two ``scripts/pretrain.py`` processes on one ``checkpoint.save``: the first is held between two
steps (its data code waits for a file, no test hook in the package) while the second starts; the
second is refused with one ``error:`` line naming the directory and the holder, exit 1, and
touches nothing; the first then finishes with its own checkpoints and an uninterleaved
``metrics.jsonl``. SIGTERM, SIGINT and errors release the lock; a lock left by a dead process is
reported as stale, never broken. The lock file's own rules are tested without training.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _runs import SMALL, train

from nemo_msa.training import checkpoint_lock
from nemo_msa.training.checkpoint_integrity import (
    file_digest,
    finished_iterations,
    latest_iteration,
    verify_checkpoint,
)
from nemo_msa.training.checkpoint_lock import (
    LOCK_NAME,
    CheckpointLockError,
    acquire,
    acquire_on_rank0,
    release,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "scripts" / "pretrain.py")

#: scripts/pretrain.py with its data source held before the step that consumes sample 4 (after
#: two steps): it writes ``waiting`` and continues once ``go`` exists.
HELD = textwrap.dedent("""
    import runpy, signal, sys, time
    from pathlib import Path
    # Ctrl-C as a terminal delivers it: a runner started as a background job passes SIGINT on
    # ignored, and Python then raises no KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {repo!r})
    from nemo_msa.training import data
    original = data.MicrobatchSource.step_microbatches

    def held(self):
        if self.consumed_samples == 4:
            Path({waiting!r}).touch()
            while not Path({go!r}).exists():
                time.sleep(0.05)
        return original(self)

    data.MicrobatchSource.step_microbatches = held
    sys.argv = ["pretrain.py", *{args!r}]
    runpy.run_path({script!r}, run_name="__main__")
""")


def _start_held(tmp_path: Path, args: list[str]) -> tuple[subprocess.Popen, Path, Path, Path]:
    """The first run, started and waited for until it is held between steps 2 and 3."""
    waiting, go, log = tmp_path / "waiting", tmp_path / "go", tmp_path / "first.log"
    driver = tmp_path / "held.py"
    driver.write_text(HELD.format(repo=str(REPO), waiting=str(waiting), go=str(go), args=args,
                                  script=SCRIPT))
    out = open(log, "w")  # noqa: SIM115 (closed with the process below)
    # Its own session, so that _finish can kill whatever it started, should a test fail.
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=out, stderr=out, cwd=REPO,
                            start_new_session=True)
    proc.log_file = out
    deadline = time.monotonic() + 240
    while not waiting.exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the first run never reached step 3"
        time.sleep(0.1)
    return proc, go, log, waiting


def _finish(proc: subprocess.Popen, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        proc.log_file.close()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root): file_digest(p) for p in root.rglob("*") if p.is_file()}


def test_a_second_run_on_the_same_directory_is_refused_and_the_first_finishes_intact(tmp_path):
    root = tmp_path / "ckpt"
    args = [*SMALL, "train.train_iters=4", f"checkpoint.save={root}",
            "checkpoint.save_interval=2"]
    first, go, log, _ = _start_held(tmp_path, args)
    try:
        lock = json.loads((root / LOCK_NAME).read_text())
        assert lock["pid"] == first.pid and lock["host"] == socket.gethostname()
        before = _snapshot(root)
        second = subprocess.run([sys.executable, SCRIPT, *args, "train.seed=7"],
                                capture_output=True, text=True, timeout=240, cwd=REPO)
        assert second.returncode == 1, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, second.stderr[-3000:]
        assert re.fullmatch(
            rf"error: checkpoint directory {re.escape(str(root))} is in use by another run "
            rf"\(host {re.escape(socket.gethostname())}, pid {first.pid}, started "
            r"\d{4}-\d\d-\d\dT[\d:]+\+00:00\): one run writes to a checkpoint directory at a "
            r"time; wait for it to finish or set another checkpoint.save \(if that run is gone, "
            rf"delete {re.escape(str(root / LOCK_NAME))}\)", errors[0]), errors[0]
        assert _snapshot(root) == before  # the refused run read the lock and nothing else
    finally:
        go.touch()
        returncode = _finish(first)
    assert returncode == 0, log.read_text()[-3000:]
    iterations = [json.loads(line)["iteration"]
                  for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert iterations == [1, 2, 3, 4]
    assert finished_iterations(root) == [2, 4] and latest_iteration(root) == 4
    assert verify_checkpoint(root / "iter_0000004") == []
    assert not (root / LOCK_NAME).exists()


def test_sigterm_releases_the_lock(tmp_path):
    """scripts/pretrain.py turns SIGTERM into an exit that unwinds (exit code 143)."""
    root = tmp_path / "ckpt"
    first, _, log, _ = _start_held(tmp_path, [*SMALL, "train.train_iters=4",
                                              f"checkpoint.save={root}"])
    assert (root / LOCK_NAME).is_file()
    first.send_signal(signal.SIGTERM)
    assert _finish(first, timeout=60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert not (root / LOCK_NAME).exists(), log.read_text()[-3000:]


def test_ctrl_c_is_one_line_naming_the_checkpoint_to_resume_from(tmp_path):
    """scripts/pretrain.py stopped by SIGINT (Ctrl-C) between steps 2 and 3: exit code 130, one
    `error:` line naming the newest checkpoint (iteration 2) and no traceback; the lock is
    released."""
    root = tmp_path / "ckpt"
    first, _, log, _ = _start_held(tmp_path, [*SMALL, "train.train_iters=4",
                                              "checkpoint.save_interval=2",
                                              f"checkpoint.save={root}"])
    first.send_signal(signal.SIGINT)
    assert _finish(first, timeout=60) == 128 + signal.SIGINT, log.read_text()[-3000:]
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert errors == [f"error: interrupted (Ctrl-C); the same command resumes from the newest "
                      f"checkpoint in {root} (iteration 2)"], text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert not (root / LOCK_NAME).exists() and latest_iteration(root) == 2


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_ctrl_c_and_errors_release_the_lock(tmp_path, monkeypatch, error):
    """SIGINT is Python's KeyboardInterrupt; it and any error unwind through pretrain()."""
    from nemo_msa.training import data

    root = tmp_path / "ckpt"

    def interrupted(self):
        assert json.loads((root / LOCK_NAME).read_text())["pid"] == os.getpid()
        raise error("stop")

    monkeypatch.setattr(data.MicrobatchSource, "step_microbatches", interrupted)
    with pytest.raises(error, match="stop"):
        train(["train.train_iters=2", f"checkpoint.save={root}"])
    assert not (root / LOCK_NAME).exists()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _write_lock(root: Path, **record) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    path.write_text(json.dumps({"started": "2026-01-01T00:00:00+00:00", "token": "x",
                                **record}))
    return path


def test_the_lock_file_names_its_holder_and_is_exclusive(tmp_path):
    root = tmp_path / "new" / "ckpt"
    lock = acquire(root)
    record = json.loads(lock.path.read_text())
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    assert record["token"] == lock.token and re.fullmatch(r"\d{4}-.*\+00:00", record["started"])
    with pytest.raises(CheckpointLockError, match=rf"is in use by another run \(host .*, pid "
                                                  rf"{os.getpid()}, started "):
        acquire(root)
    release(lock)
    assert not root.exists()  # created by the lock and left empty: removed with it
    # A directory that existed, or that the run wrote into, stays.
    lock = acquire(root)
    (root / "metrics.jsonl").write_text("")
    release(lock)
    assert sorted(p.name for p in root.iterdir()) == ["metrics.jsonl"]
    # A lock file that is no longer this run's (deleted by hand and re-taken) is left alone.
    lock = acquire(root)
    lock.path.unlink()
    other = acquire(root)
    release(lock)
    assert other.path.is_file()
    release(other)
    assert acquire_on_rank0(None) is None


def test_a_stale_lock_is_reported_not_broken(tmp_path):
    root = tmp_path / "ckpt"
    path = _write_lock(root, host=socket.gethostname(), pid=_dead_pid())
    with pytest.raises(CheckpointLockError, match=rf"checkpoint directory {re.escape(str(root))} "
                                                  r"has a stale lock: the run that took it \(host "
                                                  r".*\) is no longer running .* delete "
                                                  rf"{re.escape(str(path))} and start again"):
        acquire_on_rank0(root)
    assert path.is_file()  # reported, not broken
    # A recycled pid: alive, but not the process that took the lock (another start time).
    _write_lock(root, host=socket.gethostname(), pid=os.getpid(), proc_start_ticks=1)
    if checkpoint_lock._proc_start_ticks(os.getpid()) is not None:
        with pytest.raises(CheckpointLockError, match="has a stale lock"):
            acquire(root)
    # On another host liveness cannot be told: refused as in use, saying so.
    _write_lock(root, host="elsewhere-node-17", pid=1234)
    with pytest.raises(CheckpointLockError, match=r"in use by another run \(host "
                                                  r"elsewhere-node-17, pid 1234, started "
                                                  r"2026-01-01T00:00:00\+00:00; it runs on another "
                                                  r"host, so whether it still runs is unknown\)"):
        acquire(root)


def test_an_unreadable_lock_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_lock, "_CONTENT_WAIT_S", 0.1)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LOCK_NAME).write_text("")
    with pytest.raises(CheckpointLockError, match=r"is locked by another run \(lock file .*; it "
                                                  r"holds '', not a lock record\).* delete "):
        acquire(root)
