"""``scripts/pretrain.py`` runs stopped at a chosen point: the lock, restart and determinism tests.

A driver script wraps one function of the package (no test hook in the package) and, the first
time a condition on its arguments holds, acts:

- ``kill``: SIGKILL itself, as an OOM kill or a preemption does;
- ``cut``: write the first half of the metrics line it was asked to write, then SIGKILL itself
  (a kill in the middle of a write);
- ``hold``: create the file ``<marker>`` and wait until ``<marker>.go`` exists (the test acts
  meanwhile: starts another run, sends a signal, or kills the whole job).

It then runs ``scripts/pretrain.py`` with its own command-line arguments, as a user would, also
under torchrun (every rank wraps the function alike). :func:`start` runs it in a process group
of its own, :func:`kill_tree` SIGKILLs a job and everything it started, :func:`survivors` lists
what outlived it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from _runs import REPO, SCRIPT

_DRIVER = textwrap.dedent("""
    import importlib, os, runpy, signal, sys, time
    from pathlib import Path
    # Ctrl-C as a terminal delivers it: a runner started as a background job passes SIGINT on
    # ignored, and Python then raises no KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {repo!r})
    module = importlib.import_module({module!r})
    owner, _, name = {function!r}.rpartition(".")
    target = module
    for part in filter(None, owner.split(".")):
        target = getattr(target, part)
    original = getattr(target, name)
    marker = Path({marker!r})

    def wrapped(*args, **kwargs):
        if not marker.exists() and ({condition}):
            if {action!r} == "cut":
                import json
                with open(args[0].path, "a") as fh:
                    text = json.dumps(args[1])
                    fh.write(text[: len(text) // 2])
                    fh.flush()
            if {action!r} in ("kill", "cut"):
                os.kill(os.getpid(), signal.SIGKILL)
            marker.touch()
            while not marker.with_name(marker.name + ".go").exists():
                time.sleep(0.05)
        return original(*args, **kwargs)

    setattr(target, name, wrapped)
    sys.argv = ["pretrain.py", *sys.argv[1:]]
    runpy.run_path({script!r}, run_name="__main__")
""")


def driver(tmp_path: Path, module: str, function: str, condition: str, action: str,
           name: str = "driver") -> tuple[Path, Path]:
    """Write a driver script; returns its path and the marker a ``hold`` creates."""
    marker = tmp_path / f"{name}.held"
    path = tmp_path / f"{name}.py"
    path.write_text(_DRIVER.format(repo=str(REPO), module=module, function=function,
                                   condition=condition, action=action, marker=str(marker),
                                   script=str(SCRIPT)))
    return path, marker


def command(script: Path, args: list[str], nproc: int = 1) -> list[str]:
    """``python SCRIPT ARGS``, or the same under torchrun with ``nproc`` processes."""
    if nproc == 1:
        return [sys.executable, str(script), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--standalone", str(script), *args]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (stdout and stderr into ``log``)."""
    out = open(log, "w")  # noqa: SIM115 (closed by finish)
    proc = subprocess.Popen(cmd, stdout=out, stderr=out, cwd=REPO, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    proc.log_file = out
    return proc


def wait_for(marker: Path, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Wait until a held driver created ``marker``; fail with the log if the job ended first."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"{marker.name} never appeared"
        time.sleep(0.1)


def release_hold(marker: Path) -> None:
    """Let a held driver go on."""
    marker.with_name(marker.name + ".go").touch()


def _children() -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if state != "Z":
                found.setdefault(int(parent), []).append(int(entry.name))
        except (OSError, ValueError):
            continue  # not a process, or it ended while read
    return found


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    children, todo, seen = _children(), [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(children.get(p, []))
    return seen


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every live descendant at once, as a node's preemption does; returns
    the pids killed."""
    pids = tree(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def survivors(pids: list[int], grace_s: float = 5.0) -> list[str]:
    """Which of ``pids`` still run (not zombies) ``grace_s`` seconds after a kill, with their
    command lines."""
    def alive() -> list[str]:
        left = []
        for p in pids:
            try:
                state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")
                    left.append(f"{p}: {cmd.decode().strip()}")
            except (OSError, IndexError):
                continue
        return left

    deadline = time.monotonic() + grace_s
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            state, _, group = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
            if int(group) == pgid and state != "Z":
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    """Wait for a job started by :func:`start`; whatever it left is killed (also on failure)."""
    try:
        return proc.wait(timeout=timeout)
    finally:
        proc.log_file.close()
        kill_tree(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
