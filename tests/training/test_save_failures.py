"""A save that fails for a file-system reason (issues #29, #48): one line naming the path and the
cause, exit 1, nothing lost.

The file-system limit is real where it can be: ``RLIMIT_FSIZE`` (the process's file size limit,
SIGXFSZ ignored) set for the save of iteration 2 only, so the kernel cuts the write short. Which
write crosses it decides what Megatron hands on: Python's EFBIG, or torch's zip writer's "unexpected
pos" with no errno at all. A full disk and a full pointer file are injected where ENOSPC surfaces.
The run stops with a CheckpointError that names the checkpoint path and the cause; the previous
checkpoint and the pointer are as they were, the ``.partial`` directory is gone, and the same
command resumes from the previous checkpoint.
"""

from __future__ import annotations

import errno
import re
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _rank_processes import rank_context
from _runs import SMALL, train
from _save_agreement import agree_in_two_ranks
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from nemo_msa.training import checkpoint
from nemo_msa.training.checkpoint_integrity import (
    CheckpointError,
    finished_iterations,
    latest_iteration,
    verify_checkpoint,
)
from nemo_msa.training.checkpoint_lock import LOCK_NAME
from nemo_msa.training.save_failures import attempt_save_step, os_error_in, short_write_in

REPO = Path(__file__).resolve().parents[2]
RUN = ["train.train_iters=2", "checkpoint.save_interval=1"]


@pytest.fixture
def file_size_limit(monkeypatch):
    """``limit_save(iteration, bytes)``: the save of ``iteration`` starts a file size limit of
    that many bytes, on until the end of the test (as a real limit stays on for the error
    report)."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.getsignal(signal.SIGXFSZ)
    save = dist_checkpointing.save

    def limit_save(iteration: int, limit: int) -> None:
        def limited_save(sharded_state_dict, path, *args, **kwargs):
            if path.endswith(f"iter_{iteration:07d}.partial"):
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not death
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, before[1]))
            return save(sharded_state_dict, path, *args, **kwargs)

        monkeypatch.setattr(dist_checkpointing, "save", limited_save)

    yield limit_save
    resource.setrlimit(resource.RLIMIT_FSIZE, before)
    signal.signal(signal.SIGXFSZ, handler)


def _assert_previous_intact(root: Path) -> None:
    assert latest_iteration(root) == 1 and verify_checkpoint(root / "iter_0000001") == []
    assert not list(root.glob("*.partial")) and not (root / LOCK_NAME).exists()


#: What Megatron hands on when the limit cuts its writer short: a bytes item's write (5000) fails
#: with Python's EFBIG; a tensor's (100000) inside torch's zip writer, with no errno.
CAUSES = {
    5000: r"File too large \(errno 27 EFBIG\) writing {partial}",
    100000: (r"the file system took fewer bytes than were written \(torch's zip writer: "
             r"\[enforce fail at inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+; a full "
             r"disk, a quota or a file size limit\) writing {partial}"),
}


@pytest.mark.parametrize("limit", list(CAUSES))
def test_file_size_limit_mid_save_names_the_path_and_the_cause(tmp_path, monkeypatch,
                                                               file_size_limit, limit):
    root = tmp_path / "ckpt"
    file_size_limit(2, limit)
    with pytest.raises(CheckpointError) as err:
        train([*RUN, f"checkpoint.save={root}"])
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # the checks below write files
    partial = re.escape(str(root / "iter_0000002.partial"))
    assert re.fullmatch(
        rf"saving checkpoint iteration 2 to {re.escape(str(root))} failed: "
        + CAUSES[limit].format(partial=partial)
        + rf" \(this process may write files of at most {limit} bytes \(RLIMIT_FSIZE, "
        rf"`ulimit -f`\); [0-9.]+ (bytes|KiB|MiB|GiB) free on the file system of {partial}\); "
        rf"the previous checkpoint \({re.escape(str(root / 'iter_0000001'))}\) and "
        r"latest_checkpointed_iteration.txt are unchanged; the run resumes from it",
        str(err.value)), str(err.value)
    _assert_previous_intact(root)
    assert finished_iterations(root) == [1]
    if limit == 100000:
        monkeypatch.undo()
        resumed = train([*RUN, f"checkpoint.save={root}"])
        assert "(resumed at 1)" in resumed["steps"] and latest_iteration(root) == 2


def test_disk_full_writing_the_pointer_leaves_the_old_pointer(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    write_pointer = checkpoint._write_pointer

    def pointer_until_full(where, iteration):
        if iteration == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(where / "pointer.tmp"))
        write_pointer(where, iteration)

    monkeypatch.setattr(checkpoint, "_write_pointer", pointer_until_full)
    with pytest.raises(CheckpointError, match=r"iteration 2 .* failed: No space left on device "
                                              r"\(errno 28 ENOSPC\) writing .*pointer.tmp; the "
                                              r"previous checkpoint \(.*iter_0000001\)"):
        train([*RUN, f"checkpoint.save={root}"])
    _assert_previous_intact(root)


def test_the_cause_is_found_however_megatron_wraps_it():
    # Another rank's failure arrives pickled: only its text survives.
    remote = CheckpointException("write", {1: (RuntimeError(
        "Worker failure: [Errno 122] Disk quota exceeded: '/ckpt/iter_0000004.partial/__1_0"
        ".distcp'"), [])})
    assert os_error_in(remote, []) == (122, "Disk quota exceeded",
                                       "/ckpt/iter_0000004.partial/__1_0.distcp")
    # The local writer's exception says only <class 'OSError'>; its log line has the errno.
    local = RuntimeError("Worker failure: An error is caught while starting worker 0, error: "
                         "<class 'OSError'>")
    assert os_error_in(local, []) is None
    assert os_error_in(local, ["Local worker 0 encountered an error: [Errno 28] No space left "
                               "on device"]) == (28, "No space left on device", None)
    try:
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert os_error_in(outer, []) == (errno.EIO, "Input/output error", None)
    # torch's zip writer cut short has no errno; its text survives in the log, or in the
    # wrapper's text when the worker's message is kept.
    short = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    wrapped = CheckpointException("write", {0: (RuntimeError(f"Worker failure: {short}"), [])})
    assert os_error_in(wrapped, []) is None and short_write_in(wrapped, []) == short
    assert short_write_in(local, []) is None
    assert short_write_in(local, [f"Local worker 0 encountered an error: {short}"]) == short
    # Anything that is neither propagates as it is.
    with pytest.raises(ValueError, match="a bug"):
        attempt_save_step(lambda: (_ for _ in ()).throw(ValueError("a bug")), Path("/x"), [])


LIMITED = textwrap.dedent("""
    import resource, runpy, signal, sys
    sys.path.insert(0, {repo!r})
    from megatron.core import dist_checkpointing
    save = dist_checkpointing.save

    def limited_save(sd, path, *args, **kwargs):
        if path.endswith("iter_0000002.partial"):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
        return save(sd, path, *args, **kwargs)

    dist_checkpointing.save = limited_save
    sys.argv = ["pretrain.py", *{args!r}]
    runpy.run_path({script!r}, run_name="__main__")
""")


def test_cli_file_size_limit_is_one_error_line_and_exit_1(tmp_path):
    # The limit stays on after the save: the error line and the clean-up must still get out
    # (stderr is a pipe, which the limit does not cover).
    root = tmp_path / "ckpt"
    driver = tmp_path / "limited.py"
    driver.write_text(LIMITED.format(repo=str(REPO), limit=100000,
                                     args=[*SMALL, *RUN, "logger.plot=false",
                                           f"checkpoint.save={root}"],
                                     script=str(REPO / "scripts" / "pretrain.py")))
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert re.match(r"error: saving checkpoint iteration 2 to .* failed: the file system took "
                    r"fewer bytes than were written \(torch's zip writer: .*unexpected pos .*\) "
                    r"writing .*iter_0000002.partial \(this process may write files of at most "
                    r"100000 bytes .*\); the previous checkpoint .* unchanged", errors[0]
                    ), errors[0]
    assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-3000:]
    _assert_previous_intact(root)


def test_a_failure_that_is_not_the_file_systems_cleans_up_and_keeps_its_own_error(tmp_path,
                                                                                 monkeypatch):
    """An unrecognized error inside the writer is raised as itself (its traceback kept), after
    the same cleanup as a file-system failure: the partial directory is gone, the previous
    checkpoint and the pointer are unchanged."""
    root = tmp_path / "ckpt"
    save = dist_checkpointing.save

    def broken_save(sharded_state_dict, path, *args, **kwargs):
        if path.endswith("iter_0000002.partial"):
            raise RuntimeError("a bug in a sharded tensor's factory")
        return save(sharded_state_dict, path, *args, **kwargs)

    monkeypatch.setattr(dist_checkpointing, "save", broken_save)
    with pytest.raises(RuntimeError, match="a bug in a sharded tensor's factory"):
        train([*RUN, f"checkpoint.save={root}"])
    _assert_previous_intact(root)


def test_every_rank_agrees_on_a_failure_that_is_not_the_file_systems(tmp_path):
    """Two gloo ranks: rank 0's unrecognized error reaches rank 1 as a failure naming the rank
    (before, rank 1 waited at the agreement until the group's timeout), and rank 0 keeps its own
    exception to re-raise; a file-system failure on rank 1 alone reaches rank 0."""
    ctx = rank_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=agree_in_two_ranks, args=(rank, str(tmp_path / "store"), results))
             for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"rank process exit code {p.exitcode} (a hang reads None)"
    got = sorted(results.get(timeout=10) for _ in procs)
    expected_first = "rank 0: RuntimeError: not a file-system error"
    expected_second = "No space left on device (errno 28 ENOSPC) writing /ckpt/shard_1"
    assert got == [(0, expected_first, "RuntimeError", expected_second, None),
                   (1, expected_first, None, expected_second, None)], got
