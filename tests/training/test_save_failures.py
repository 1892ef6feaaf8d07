"""A disk that fills up during a save (issue #29): one line naming the path and the cause, exit 1,
nothing lost.

The fault is injected where a real ENOSPC surfaces: in dist-checkpointing's file writer (whose
threads catch the OSError and hand on only "Worker failure ... <class 'OSError'>"), and in this
package's own pointer write. The run stops with a CheckpointError that names the checkpoint
path and "No space left on device (errno 28 ENOSPC)"; the previous checkpoint and the pointer
are as they were, the ``.partial`` directory is gone, and the same command resumes from the
previous checkpoint.
"""

from __future__ import annotations

import errno
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _runs import SMALL, train
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint.api import CheckpointException

from nemo_msa.training import checkpoint
from nemo_msa.training.checkpoint_integrity import (
    CheckpointError,
    finished_iterations,
    latest_iteration,
    verify_checkpoint,
)
from nemo_msa.training.checkpoint_lock import LOCK_NAME
from nemo_msa.training.save_failures import attempt_save_step, os_error_in

REPO = Path(__file__).resolve().parents[2]
RUN = ["train.train_iters=2", "checkpoint.save_interval=1"]


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _fail_writes_of(monkeypatch, iteration: int) -> None:
    """Every tensor write of the save of ``iteration`` raises ENOSPC (the disk just filled)."""
    save = dist_checkpointing.save

    def save_until_full(sharded_state_dict, path, *args, **kwargs):
        if path.endswith(f"iter_{iteration:07d}.partial"):
            monkeypatch.setattr(filesystem_async, "_write_item", _no_space)
        return save(sharded_state_dict, path, *args, **kwargs)

    monkeypatch.setattr(dist_checkpointing, "save", save_until_full)


def _assert_previous_intact(root: Path) -> None:
    assert latest_iteration(root) == 1 and verify_checkpoint(root / "iter_0000001") == []
    assert not list(root.glob("*.partial")) and not (root / LOCK_NAME).exists()


def test_disk_full_inside_megatrons_writer_names_the_path_and_the_cause(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    _fail_writes_of(monkeypatch, 2)
    with pytest.raises(CheckpointError) as err:
        train([*RUN, f"checkpoint.save={root}"])
    assert re.fullmatch(
        rf"saving checkpoint iteration 2 to {re.escape(str(root))} failed: No space left on "
        rf"device \(errno 28 ENOSPC\) writing {re.escape(str(root / 'iter_0000002.partial'))}; "
        rf"the previous checkpoint \({re.escape(str(root / 'iter_0000001'))}\) and "
        r"latest_checkpointed_iteration.txt are unchanged; the run resumes from it",
        str(err.value)), str(err.value)
    _assert_previous_intact(root)
    assert finished_iterations(root) == [1]
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
    # Anything that is not an OSError propagates as it is.
    with pytest.raises(ValueError, match="a bug"):
        attempt_save_step(lambda: (_ for _ in ()).throw(ValueError("a bug")), Path("/x"), [])


DISK_FILLS = textwrap.dedent("""
    import errno, runpy, sys
    sys.path.insert(0, {repo!r})
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    save = dist_checkpointing.save

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def save_until_full(sd, path, *args, **kwargs):
        if path.endswith("iter_0000002.partial"):
            filesystem_async._write_item = no_space
        return save(sd, path, *args, **kwargs)

    dist_checkpointing.save = save_until_full
    sys.argv = ["pretrain.py", *{args!r}]
    runpy.run_path({script!r}, run_name="__main__")
""")


def test_cli_disk_full_is_one_error_line_and_exit_1(tmp_path):
    root = tmp_path / "ckpt"
    driver = tmp_path / "disk_fills.py"
    driver.write_text(DISK_FILLS.format(repo=str(REPO), args=[*SMALL, *RUN,
                                                              f"checkpoint.save={root}"],
                                        script=str(REPO / "scripts" / "pretrain.py")))
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert re.match(r"error: saving checkpoint iteration 2 to .* failed: No space left on device "
                    r"\(errno 28 ENOSPC\) writing .*iter_0000002.partial; the previous "
                    r"checkpoint .* unchanged", errors[0]), errors[0]
    assert "Traceback" not in proc.stderr
    _assert_previous_intact(root)
