"""A SIGKILL during a save, between the rename and the pointer, or between saves: the same
command, once the killed run's stale lock file is deleted (it is reported, not broken), resumes
from the newest finished checkpoint and continues the curve bit-exactly.

The killed run is ``scripts/pretrain.py`` in a child process whose checkpoint or data code is
wrapped to SIGKILL the process at the chosen point (no test hook in the package); the resumed
run is the same command, in this process, compared with the uninterrupted reference. The child
runs in its own process group, and once it is killed no process of that group may remain (issue
#48: Megatron's writer used to leave a spawned multiprocessing Manager and the resource tracker
behind, orphaned, at every kill point).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _runs import REFERENCE, SMALL, losses, train

from nemo_msa.training.checkpoint_integrity import (
    finished_iterations,
    latest_iteration,
    verify_checkpoint,
)
from nemo_msa.training.checkpoint_lock import LOCK_NAME, CheckpointLockError

REPO = Path(__file__).resolve().parents[2]

#: Where the child kills itself: module, function, and the condition on its arguments.
KILL_POINTS = {
    # dist-checkpointing has written iter_6.partial; no manifest, no rename.
    "during the save": ("nemo_msa.training.checkpoint", "write_manifest",
                        "args[1] == 6"),
    # iter_6 is complete and renamed, the pointer still names 3.
    "before the pointer": ("nemo_msa.training.checkpoint", "_write_pointer", "args[1] == 6"),
    # Step 5 is about to read its data: iter_3 is the newest checkpoint.
    "between saves": ("nemo_msa.training.data", "MicrobatchSource.step_microbatches",
                      "args[0].consumed_samples == 8"),
}

DRIVER = textwrap.dedent("""
    import os, runpy, signal, sys, importlib
    sys.path.insert(0, {repo!r})
    module = importlib.import_module({module!r})
    owner, _, name = {function!r}.rpartition(".")
    target = getattr(module, owner) if owner else module
    original = getattr(target, name)

    def wrapped(*args, **kwargs):
        if {condition}:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(target, name, wrapped)
    sys.argv = ["pretrain.py", *{args!r}]
    runpy.run_path({script!r}, run_name="__main__")
""")


def _live_members(pgid: int) -> list[str]:
    """The live (not zombie) processes of process group ``pgid``: pid and command line."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            state, _, group = stat.rsplit(")", 1)[1].split()[:3]
            if int(group) == pgid and state != "Z":
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{entry.name}: {cmd.strip()}")
        except (OSError, ValueError):
            continue  # not a process, or it ended while read
    return found


def _survivors(pgid: int, grace_s: float = 5.0) -> list[str]:
    """What of the group is still alive ``grace_s`` seconds after its leader was killed."""
    deadline = time.monotonic() + grace_s
    while (left := _live_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_then_the_same_command_resumes_bit_exactly(reference, tmp_path, point):
    _, ref = reference
    module, function, condition = KILL_POINTS[point]
    root = tmp_path / "ckpt"
    args = [*SMALL, *REFERENCE, f"checkpoint.save={root}", "checkpoint.save_interval=3"]
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO), module=module, function=function,
                                    condition=condition, args=args,
                                    script=str(REPO / "scripts" / "pretrain.py")))
    log = tmp_path / "child.log"
    with open(log, "w") as out:
        # Its own process group, so that whatever it started can be found (and, should the test
        # fail, killed) by the group.
        proc = subprocess.Popen([sys.executable, str(driver)], stdout=out, stderr=out, cwd=REPO,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=300)
            survivors = _survivors(proc.pid)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert survivors == [], survivors
    assert latest_iteration(root) == 3
    if point == "during the save":
        assert (root / "iter_0000006.partial").is_dir() and finished_iterations(root) == [3]
    elif point == "before the pointer":
        assert finished_iterations(root) == [3, 6]
    else:
        assert finished_iterations(root) == [3]

    # The killed run could not remove its lock: the same command reports it as stale (ADR 0024)
    # and changes nothing; deleting the file, as the message says, lets it resume.
    with pytest.raises(CheckpointLockError, match=r"has a stale lock: .* delete .*\.nemo_msa"
                                                  r"\.lock and start again"):
        train(args[len(SMALL):])
    assert latest_iteration(root) == 3
    (root / LOCK_NAME).unlink()
    resumed = train(args[len(SMALL):])
    assert "(resumed at 3)" in resumed["steps"]
    want, got = losses(ref["history"]), losses(resumed["history"])
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for it in (4, 5, 6):
        assert got[it] == want[it], (point, it, got[it], want[it])  # bitwise on the CPU
    assert latest_iteration(root) == 6 and verify_checkpoint(root / "iter_0000006") == []
    assert not (root / "iter_0000006.partial").exists()
