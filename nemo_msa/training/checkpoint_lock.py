"""One writer per checkpoint directory: a lock file taken before the directory is first read.

``checkpoint.save/.nemo_msa.lock`` is created with ``O_CREAT | O_EXCL`` (atomic on local file
systems and on NFSv3+, unlike ``fcntl`` locks, which many shared file systems do not carry across
hosts) and holds the holder's host, pid, process start time and a random token, as JSON. Only
rank 0 takes it, before any rank reads the directory (the outcome is broadcast, which is the
barrier); it is removed when the run ends, normally or by an exception (SIGINT, and SIGTERM,
which ``scripts/pretrain.py`` turns into an exit), and only when it still holds this run's token.

A lock whose holder is gone (SIGKILL, OOM kill, power loss) is reported, never broken silently:
on the holder's own host a pid that is not running (or runs another process, by its start time)
is called stale and the message says to delete the file; on another host liveness cannot be
told, so the message names the host and pid to check (ADR 0024).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_msa.training.checkpoint_integrity import CheckpointError

#: The lock file's name inside ``checkpoint.save``.
LOCK_NAME = ".nemo_msa.lock"
#: How long a reader waits for a just-created lock file to get its contents.
_CONTENT_WAIT_S = 2.0


class CheckpointLockError(CheckpointError):
    """Another run holds (or held and left behind) the lock of a checkpoint directory."""


@dataclass
class CheckpointLock:
    """A lock this process holds."""

    #: The lock file.
    path: Path
    #: The random token written into it, checked before removing it.
    token: str
    #: The checkpoint directory did not exist before the lock created it (removed again when
    #: the run leaves it empty).
    created_root: bool


def _proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # Field 22; the command name (field 2) may hold spaces, so split after its ')'.
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _holder_record(token: str) -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "proc_start_ticks": _proc_start_ticks(pid), "token": token}


def _read_holder(path: Path) -> dict | None:
    """The lock file's record; None when it is gone. Waits briefly for a file being written."""
    deadline = time.monotonic() + _CONTENT_WAIT_S
    while True:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as err:
            return {"unreadable": f"{type(err).__name__}: {err}"}
        try:
            record = json.loads(text)
            if isinstance(record, dict):
                return record
        except json.JSONDecodeError:
            pass
        if time.monotonic() > deadline:
            return {"unreadable": f"it holds {text[:80]!r}, not a lock record"}
        time.sleep(0.05)


def _alive(record: dict) -> bool | None:
    """Whether the holder still runs: True/False on its own host, None on another host."""
    if record.get("host") != socket.gethostname():
        return None
    try:
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    ticks = record.get("proc_start_ticks")
    now = _proc_start_ticks(pid)
    # A recycled pid: the process running under it started at another time.
    return not (ticks is not None and now is not None and int(ticks) != now)


def _refusal(root: Path, path: Path, record: dict) -> CheckpointLockError:
    if "unreadable" in record:
        return CheckpointLockError(
            f"checkpoint directory {root} is locked by another run (lock file {path}; "
            f"{record['unreadable']}): wait for that run or set another checkpoint.save; if no "
            f"run writes to {root}, delete {path}")
    holder = (f"host {record.get('host')}, pid {record.get('pid')}, started "
              f"{record.get('started')}")
    alive = _alive(record)
    if alive is False:
        return CheckpointLockError(
            f"checkpoint directory {root} has a stale lock: the run that took it ({holder}) is "
            f"no longer running (killed before it could remove {path}); if no other run writes "
            f"to {root}, delete {path} and start again")
    where = "" if alive else "; it runs on another host, so whether it still runs is unknown"
    return CheckpointLockError(
        f"checkpoint directory {root} is in use by another run ({holder}{where}): one run "
        f"writes to a checkpoint directory at a time; wait for it to finish or set another "
        f"checkpoint.save (if that run is gone, delete {path})")


def acquire(root: str | os.PathLike) -> CheckpointLock:
    """Take the lock of ``root`` in this process (creating ``root`` if needed).

    Raises:
        CheckpointLockError: another run holds the lock, or left a stale one; names the
            directory, the holder's host, pid and start time, and how to clear it.
        OSError: the directory or the lock file cannot be created (permissions, read-only).
    """
    root = Path(root)
    created_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    token = uuid.uuid4().hex
    body = json.dumps(_holder_record(token)).encode()
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            record = _read_holder(path)
            if record is None:
                continue  # released between our attempt and the read: try again
            raise _refusal(root, path, record) from None
        break
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    return CheckpointLock(path, token, created_root)


def release(lock: CheckpointLock | None) -> None:
    """Remove the lock file if it still holds this run's token; never raises."""
    if lock is None:
        return
    record = _read_holder(lock.path)
    if record is None or record.get("token") != lock.token:
        return  # removed by hand, perhaps re-taken by another run: not ours to remove
    try:
        lock.path.unlink()
        if lock.created_root:
            lock.path.parent.rmdir()  # only succeeds when the run wrote nothing
    except OSError as err:
        if err.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            print(f"warning: could not remove the checkpoint lock {lock.path}: {err}",
                  file=sys.stderr, flush=True)


def acquire_on_rank0(root: str | os.PathLike | None) -> CheckpointLock | None:
    """Rank 0 takes the lock of ``root``; every rank learns the outcome (collective).

    Every rank waits here until rank 0 holds the lock, so no rank reads the directory first.

    Returns:
        The lock on rank 0, None on the other ranks and when ``root`` is None.

    Raises:
        CheckpointLockError: on every rank when rank 0 could not take it (same message).
    """
    if root is None:
        return None
    distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    rank = torch.distributed.get_rank() if distributed else 0
    lock, failure = None, None
    if rank == 0:
        try:
            lock = acquire(root)
        except CheckpointLockError as err:
            failure = str(err)
        except OSError as err:
            failure = (f"cannot create the checkpoint lock in {root}: "
                       f"{err.strerror or err} ({type(err).__name__})")
    if distributed:
        box = [failure]
        torch.distributed.broadcast_object_list(box, src=0)
        failure = box[0]
    if failure is not None:
        raise CheckpointLockError(failure)
    return lock


__all__ = ["LOCK_NAME", "CheckpointLock", "CheckpointLockError", "acquire", "acquire_on_rank0",
           "release"]
