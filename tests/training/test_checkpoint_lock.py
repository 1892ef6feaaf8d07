"""One writer per checkpoint directory (issue #29 case 1, ADRs 0024 and 0049).

Two runs on one ``checkpoint.save``: the first ``scripts/pretrain.py`` process is held between
two steps (its data code waits for a file, no test hook in the package) while its heartbeat
advances; the second, the CLI's ``main()`` in this process, is refused with one ``error:`` line
naming the directory and the holder, exit 1, and touches nothing. SIGTERM then stops the first
(exit 143), releasing its lock, and the same command finishes the run with an uninterleaved
``metrics.jsonl``. SIGINT and errors release the lock. The lock file's rules (heartbeat,
takeover of a gone holder, refusal of a live one, the race of two restarts) are tested without
training.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from _interrupt import command, driver, finish, release_hold, start, wait_for
from _runs import SMALL, cli, train

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
    check,
    release,
)


def _start_held(tmp_path: Path, args: list[str]):
    """The first run, started and waited for until it is held between steps 2 and 3."""
    path, marker = driver(tmp_path, "nemo_msa.training.data", "MicrobatchSource.step_microbatches",
                          "args[0].consumed_samples == 4", "hold", name="first")
    log = tmp_path / "first.log"
    proc = start(command(path, args), log)
    wait_for(marker, proc, log)
    return proc, marker, log


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root): file_digest(p) for p in root.rglob("*")
            if p.is_file() and p.name != LOCK_NAME}


def test_a_second_run_is_refused_then_sigterm_releases_and_the_same_command_resumes(
        tmp_path, capfd):
    root = tmp_path / "ckpt"
    args = [*SMALL, "train.train_iters=4", f"checkpoint.save={root}",
            "checkpoint.save_interval=2", "checkpoint.lock_stale_s=2"]
    first, marker, log = _start_held(tmp_path, args)
    try:
        lock = json.loads((root / LOCK_NAME).read_text())
        assert lock["pid"] == first.pid and lock["host"] == socket.gethostname()
        assert lock["heartbeat_s"] == 0.5  # lock_stale_s / 4
        # The holder's heartbeat thread runs while its main thread is held.
        deadline = time.monotonic() + 30
        while json.loads((root / LOCK_NAME).read_text())["heartbeat"] == lock["heartbeat"]:
            assert time.monotonic() < deadline, "the heartbeat never advanced"
            time.sleep(0.1)
        before = _snapshot(root)
        capfd.readouterr()
        assert cli(*args, "train.seed=7") == 1
        errors = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error:")]
        assert len(errors) == 1, errors
        assert re.fullmatch(
            rf"error: checkpoint directory {re.escape(str(root))} is in use by another run "
            rf"\(host {re.escape(socket.gethostname())}, pid {first.pid}, started "
            r"\d{4}-\d\d-\d\dT[\d:]+\+00:00; it runs on this host\): one run writes to a "
            r"checkpoint directory at a time; wait for it to finish or set another "
            r"checkpoint.save", errors[0]), errors[0]
        assert _snapshot(root) == before  # the refused run read the lock and nothing else
        first.send_signal(signal.SIGTERM)
        assert finish(first, timeout=60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        release_hold(marker)
        finish(first)
    assert not (root / LOCK_NAME).exists(), log.read_text()[-3000:]
    assert latest_iteration(root) == 2
    summary = train(args[len(SMALL):])  # the same command, after the first stopped
    assert "(resumed at 2)" in summary["steps"]
    iterations = [json.loads(line)["iteration"]
                  for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert iterations == [1, 2, 3, 4]
    assert finished_iterations(root) == [2, 4] and latest_iteration(root) == 4
    assert verify_checkpoint(root / "iter_0000004") == []
    assert not (root / LOCK_NAME).exists()


def test_ctrl_c_is_one_line_naming_the_checkpoint_to_resume_from(tmp_path):
    """scripts/pretrain.py stopped by SIGINT (Ctrl-C) between steps 2 and 3: exit code 130, one
    `error:` line naming the newest checkpoint (iteration 2) and no traceback; the lock is
    released."""
    root = tmp_path / "ckpt"
    first, marker, log = _start_held(tmp_path, [*SMALL, "train.train_iters=4",
                                                "checkpoint.save_interval=2",
                                                f"checkpoint.save={root}"])
    first.send_signal(signal.SIGINT)
    assert finish(first, timeout=60) == 128 + signal.SIGINT, log.read_text()[-3000:]
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


def test_a_run_whose_lock_was_taken_over_stops_before_writing_again(tmp_path, monkeypatch):
    """A holder judged gone (a stalled heartbeat) whose lock another run took over: the loop
    stops after the step, before its metrics line and its checkpoint."""
    from nemo_msa.training import data

    root = tmp_path / "ckpt"
    original = data.MicrobatchSource.step_microbatches

    def taken_over(self):
        if self.consumed_samples == 2:  # step 2: another run replaces the lock file
            (root / LOCK_NAME).unlink()
            (root / LOCK_NAME).write_text("{}")
        return original(self)

    monkeypatch.setattr(data.MicrobatchSource, "step_microbatches", taken_over)
    with pytest.raises(CheckpointLockError, match=r"the lock of checkpoint directory .* was "
                                                  r"deleted or taken over by another run .* "
                                                  r"stopped after iteration 2 without writing"):
        train(["train.train_iters=3", f"checkpoint.save={root}", "checkpoint.save_interval=2"])
    rows = (root / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in rows] == [1]
    assert finished_iterations(root) == []
    assert (root / LOCK_NAME).read_text() == "{}"  # the other run's lock is left alone


# ------------------------------------------------------------------------ the lock file alone


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _ago(seconds: float) -> str:
    moment = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds)
    return moment.isoformat(timespec="microseconds")


def _write_lock(root: Path, **record) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    path.write_text(json.dumps({"started": "2026-01-01T00:00:00+00:00", "token": "old",
                                "heartbeat": _ago(0), "heartbeat_s": 0.1, **record}))
    return path


def _takes_over(root: Path, why: str, stale_s: float | None = 0.5) -> float:
    """Acquire over the lock in place: it is taken over with a line saying ``why``; returns
    the seconds it took."""
    t0 = time.monotonic()
    lock, line = acquire(root, stale_s, heartbeat=False)
    try:
        assert line is not None and re.search(why, line), line
        assert line.startswith(f"warning: checkpoint directory {root}: took over ")
        assert line.endswith("; the run resumes from the newest verified checkpoint there, "
                             "if any")
        assert json.loads(lock.path.read_text())["token"] == lock.token
        assert not list(root.glob(f"{LOCK_NAME}.stale-*"))  # the old file is gone
    finally:
        release(lock)
    return time.monotonic() - t0


def test_the_lock_file_names_its_holder_beats_and_is_exclusive(tmp_path):
    root = tmp_path / "new" / "ckpt"
    lock, line = acquire(root, stale_s=0.2)
    assert line is None and lock.heartbeat_s == pytest.approx(0.05)
    record = json.loads(lock.path.read_text())
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    assert record["token"] == lock.token and re.fullmatch(r"\d{4}-.*\+00:00", record["started"])
    size = lock.path.stat().st_size
    deadline = time.monotonic() + 10
    while json.loads(lock.path.read_text())["heartbeat"] == record["heartbeat"]:
        assert time.monotonic() < deadline, "the heartbeat never advanced"
        time.sleep(0.05)
    assert lock.path.stat().st_size == size  # rewritten in place, at one length
    # This process holds it: live, refused at once whatever the timeout.
    with pytest.raises(CheckpointLockError, match=rf"is in use by another run \(host .*, pid "
                                                  rf"{os.getpid()}, started .*; it runs on this "
                                                  r"host\)"):
        acquire(root, stale_s=0.2, heartbeat=False)
    assert check(lock) is None
    release(lock)
    assert not root.exists()  # created by the lock and left empty: removed with it
    # A directory that existed, or that the run wrote into, stays.
    lock, _ = acquire(root, heartbeat=False)
    (root / "metrics.jsonl").write_text("")
    release(lock)
    assert sorted(p.name for p in root.iterdir()) == ["metrics.jsonl"]
    # A lock file that is no longer this run's (deleted by hand and re-taken) is left alone, and
    # the holder learns it lost the lock.
    lock, _ = acquire(root, heartbeat=False)
    lock.path.unlink()
    assert check(lock) == f"the lock file {lock.path} was deleted"
    other, _ = acquire(root, heartbeat=False)
    release(lock)
    assert other.path.is_file()
    release(other)
    assert acquire_on_rank0(None) is None


def test_a_lock_whose_holder_is_gone_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_lock, "_CONTENT_WAIT_S", 0.1)
    root = tmp_path / "ckpt"
    host = socket.gethostname()
    # SIGKILL on this host: the pid runs no more.
    dead = _dead_pid()
    _write_lock(root, host=host, pid=dead)
    # At once: no wait for the timeout.
    assert _takes_over(root, rf"\(host {host}, pid {dead}, started .*\): pid {dead} is no "
                             r"longer running on this host", stale_s=30) < 10
    # A recycled pid: alive, but not the process that took the lock (another start time).
    if checkpoint_lock._proc_start_ticks(os.getpid()) is not None:
        _write_lock(root, host=host, pid=os.getpid(), proc_start_ticks=1)
        _takes_over(root, rf"pid {os.getpid()} now runs another process")
    # Another host whose heartbeat stopped long ago: at once.
    _write_lock(root, host="elsewhere-node-17", pid=1234, heartbeat=_ago(60))
    assert _takes_over(root, r"its heartbeat stopped 60 s ago \(checkpoint.lock_stale_s = "
                             r"30\)", stale_s=30) < 10
    # This host name but another pid namespace (a container): judged by the heartbeat, not by
    # the pid (this very process's, alive here).
    _write_lock(root, host=host, pid=os.getpid(), pid_namespace=1, heartbeat=_ago(5))
    _takes_over(root, "its heartbeat stopped 5 s ago")
    # Another host, a recent heartbeat that does not advance: watched until it is too old.
    _write_lock(root, host="elsewhere-node-17", pid=1234, heartbeat=_ago(0.2))
    assert _takes_over(root, "its heartbeat stopped") > 0.25
    # The holder's own heartbeat interval counts: never called stopped before two of them.
    _write_lock(root, host="elsewhere-node-17", pid=1234, heartbeat=_ago(1.0), heartbeat_s=0.6)
    assert _takes_over(root, "its heartbeat stopped") > 0.15
    # A lock file without a record (killed between creating and writing it), unchanged longer
    # than the timeout.
    root.mkdir(exist_ok=True)
    (root / LOCK_NAME).write_text("")
    os.utime(root / LOCK_NAME, (time.time() - 60, time.time() - 60))
    _takes_over(root, r"took over a lock file without a record: the lock file holds no record "
                      r"and has not changed for 6\d s")


def test_a_live_holder_elsewhere_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_lock, "_CONTENT_WAIT_S", 0.1)
    root = tmp_path / "ckpt"
    # Its heartbeat advances while the new run watches.
    path = _write_lock(root, host="elsewhere-node-17", pid=1234)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            record = json.loads(path.read_text())
            record["heartbeat"] = _ago(0)
            path.write_text(json.dumps(record))

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(CheckpointLockError, match=r"in use by another run \(host "
                                                      r"elsewhere-node-17, pid 1234, started "
                                                      r"2026-01-01T00:00:00\+00:00; its "
                                                      r"heartbeat advanced while this run "
                                                      r"waited\)"):
            acquire(root, stale_s=5.0, heartbeat=False)
    finally:
        stop.set()
        beating.join()
    # checkpoint.lock_stale_s = null: a lock held elsewhere is never taken over.
    _write_lock(root, host="elsewhere-node-17", pid=1234, heartbeat=_ago(3600))
    with pytest.raises(CheckpointLockError, match=r"checkpoint.lock_stale_s is null"):
        acquire_on_rank0(root, stale_s=None)
    assert json.loads(path.read_text())["token"] == "old"  # refused, never broken
    (root / LOCK_NAME).write_text("")
    with pytest.raises(CheckpointLockError, match=r"is locked by another run \(lock file .*; it "
                                                  r"holds '', not a lock record\).* delete "):
        acquire(root, stale_s=None)


def test_two_restarts_taking_over_one_lock_leave_one_holder(tmp_path):
    """The second restart's rename catches the first one's fresh lock instead of the dead run's:
    it puts the file back and judges again (the holder is live: refused)."""
    root = tmp_path / "ckpt"
    dead = _write_lock(root, host=socket.gethostname(), pid=_dead_pid())
    stale = json.loads(dead.read_text())
    winner, line = acquire(root, heartbeat=False)
    assert line is not None
    assert not checkpoint_lock._take_over(root / LOCK_NAME, stale)  # judged the dead run's
    assert json.loads((root / LOCK_NAME).read_text())["token"] == winner.token
    assert check(winner) is None  # the same file (inode) is back
    with pytest.raises(CheckpointLockError, match="it runs on this host"):
        acquire(root, heartbeat=False)
    release(winner)
    assert not (root / LOCK_NAME).exists()

