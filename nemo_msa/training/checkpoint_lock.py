"""One writer per checkpoint directory: a lock file with a heartbeat, taken over once its holder
is provably gone.

``checkpoint.save/.nemo_msa.lock`` is created with ``O_CREAT | O_EXCL`` (atomic on local file
systems and on NFSv3+, unlike ``fcntl`` locks, which many shared file systems do not carry across
hosts). It holds, as JSON: the holder's host, pid, start time, the process's start time in clock
ticks and the machine's boot id and pid namespace (``/proc``, to tell a recycled pid and another
container of the same host name), a random token, and a heartbeat that a background thread of the
holder rewrites every ``heartbeat_s`` seconds. Only rank 0 takes it, before any rank reads the
directory (the outcome is broadcast, which is the barrier); it is removed when the run ends
(normally, by an exception, SIGINT, or SIGTERM, which ``scripts/pretrain.py`` turns into an
exit), and only while it still holds this run's token.

A lock found in place is judged (ADR 0049):

- **live**, refused: on this machine (same host, boot and pid namespace) its pid runs the
  process that took it; elsewhere its heartbeat advanced while we watched.
- **gone**, taken over with one ``warning:`` line: on this machine the pid is not running (or
  runs a process that started at another time, a recycled pid); elsewhere (another host name,
  boot or pid namespace) the heartbeat is older than ``checkpoint.lock_stale_s`` (and than two
  of the holder's heartbeat intervals). A lock file without a record (a run killed between
  creating and writing it) is gone once it has not changed for that long.
- **undecided**: the holder is on another machine and its heartbeat is younger than the timeout.
  The new run watches the heartbeat until it advances (live) or grows older than the timeout
  (gone), so a requeued job on another node waits at most ``lock_stale_s`` instead of failing.

The takeover renames the old file aside and checks it is the one judged (another restart may
have taken the lock in between); a holder whose lock file was taken away notices it at its next
heartbeat (:attr:`CheckpointLock.lost`), and the training loop stops before it writes again.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nemo_msa.training.checkpoint_integrity import CheckpointError

#: The lock file's name inside ``checkpoint.save``.
LOCK_NAME = ".nemo_msa.lock"
#: How long a reader waits for a just-created lock file to get its contents.
_CONTENT_WAIT_S = 2.0
#: The longest heartbeat interval: the holder rewrites its record at least this often.
MAX_HEARTBEAT_S = 30.0
#: The heartbeat interval as a share of ``checkpoint.lock_stale_s``.
_HEARTBEATS_PER_TIMEOUT = 4
#: A holder's heartbeat is called stopped only after at least this many of its intervals.
_MIN_MISSED_HEARTBEATS = 2


class CheckpointLockError(CheckpointError):
    """Another run holds the lock of a checkpoint directory (or took this run's lock away)."""


@dataclass
class CheckpointLock:
    """A lock this process holds, with the thread that keeps its heartbeat."""

    #: The lock file.
    path: Path
    #: The random token written into it, checked before removing it.
    token: str
    #: The checkpoint directory did not exist before the lock created it (removed again when
    #: the run leaves it empty).
    created_root: bool
    #: Seconds between heartbeats (None: no heartbeat thread).
    heartbeat_s: float | None = None
    #: Why the lock is no longer this run's (its file was deleted or taken over), once the
    #: heartbeat finds it so; None while it holds.
    lost: str | None = None
    _fd: int | None = field(default=None, repr=False)
    _record: dict = field(default_factory=dict, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _timestamp(moment: datetime.datetime) -> str:
    # Fixed width (microseconds always written): the heartbeat rewrites the record in place at
    # one length, so a reader never sees a longer old record's tail.
    return moment.isoformat(timespec="microseconds")


def _proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # Field 22; the command name (field 2) may hold spaces, so split after its ')'.
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> str | None:
    """This boot of the machine (Linux), None elsewhere: a pid is only meaningful within it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _pid_namespace() -> int | None:
    """The inode of this process's pid namespace (Linux), None elsewhere: two containers of one
    host name see different processes under the same pid."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def heartbeat_interval(stale_s: float | None) -> float:
    """Seconds between a holder's heartbeats for a timeout of ``stale_s`` (None: the longest)."""
    if stale_s is None:
        return MAX_HEARTBEAT_S
    return min(MAX_HEARTBEAT_S, stale_s / _HEARTBEATS_PER_TIMEOUT)


def _holder_record(token: str, heartbeat_s: float) -> dict:
    pid = os.getpid()
    now = _now()
    return {"host": socket.gethostname(), "pid": pid,
            "started": now.isoformat(timespec="seconds"),
            "proc_start_ticks": _proc_start_ticks(pid), "boot_id": _boot_id(),
            "pid_namespace": _pid_namespace(), "token": token,
            "heartbeat": _timestamp(now), "heartbeat_s": heartbeat_s}


def _read_holder(path: Path) -> dict | None:
    """The lock file's record; None when it is gone. Waits briefly for a file being written.

    A record that cannot be read carries ``unreadable`` (what is wrong) instead; every record
    carries ``_mtime`` (the file's modification time, seconds since the epoch).
    """
    deadline = time.monotonic() + _CONTENT_WAIT_S
    while True:
        try:
            text = path.read_text()
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None
        except OSError as err:
            return {"unreadable": f"{type(err).__name__}: {err}", "_mtime": None}
        try:
            record = json.loads(text)
            if isinstance(record, dict):
                return {**record, "_mtime": mtime}
        except json.JSONDecodeError:
            pass
        if time.monotonic() > deadline:
            return {"unreadable": f"it holds {text[:80]!r}, not a lock record", "_mtime": mtime}
        time.sleep(0.05)


def _heartbeat_age(record: dict) -> float | None:
    """Seconds since the holder's last heartbeat (the file's mtime for a record without one)."""
    try:
        beat = datetime.datetime.fromisoformat(record["heartbeat"]).timestamp()
    except (KeyError, TypeError, ValueError):
        beat = record.get("_mtime")
    return None if beat is None else time.time() - beat


def _same_machine(record: dict) -> bool:
    """Whether the holder's pid is meaningful here: same host, boot and pid namespace (each
    compared where both sides know it)."""
    if record.get("host") != socket.gethostname():
        return False
    ours = {"boot_id": _boot_id(), "pid_namespace": _pid_namespace()}
    return all(record.get(k) is None or v is None or record.get(k) == v for k, v in ours.items())


@dataclass(frozen=True)
class _Verdict:
    """What a lock found in place tells: ``live``, ``gone`` or ``undecided`` (and why)."""

    state: str
    why: str


def _judge(record: dict, stale_s: float | None) -> _Verdict:
    """Whether the lock's holder still runs (see the module docstring)."""
    limit = None if stale_s is None else max(
        stale_s, _MIN_MISSED_HEARTBEATS * float(record.get("heartbeat_s") or 0.0))
    age = _heartbeat_age(record)
    if "unreadable" in record:
        if age is None:  # not even its modification time: nothing proves the holder gone
            return _Verdict("live", "the lock file cannot be read")
        if limit is not None and age > limit:
            return _Verdict("gone", f"the lock file holds no record and has not changed for "
                                    f"{age:.0f} s (checkpoint.lock_stale_s = {stale_s:g})")
        return _Verdict("undecided", "the lock file holds no record yet")
    # Another boot or pid namespace under the same host name (a reboot, or a container of the
    # same name elsewhere) is judged like another host: by the heartbeat.
    if _same_machine(record):
        try:
            pid = int(record["pid"])
        except (KeyError, TypeError, ValueError):
            pid = None
        if pid is not None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return _Verdict("gone", f"pid {pid} is no longer running on this host")
            except PermissionError:
                pass  # another user's process: it exists
            ticks, now = record.get("proc_start_ticks"), _proc_start_ticks(pid)
            if ticks is not None and now is not None and int(ticks) != now:
                return _Verdict("gone", f"pid {pid} now runs another process (started at "
                                        "another time)")
            return _Verdict("live", "it runs on this host")
    if age is None:  # nothing proves the holder gone
        return _Verdict("live", "it runs on another host and its heartbeat cannot be read")
    if limit is not None and age > limit:
        return _Verdict("gone", f"its heartbeat stopped {age:.0f} s ago "
                                f"(checkpoint.lock_stale_s = {stale_s:g})")
    return _Verdict("undecided", f"its last heartbeat was {max(age, 0.0):.0f} s ago")


def _holder(record: dict) -> str:
    return (f"host {record.get('host')}, pid {record.get('pid')}, started "
            f"{record.get('started')}")


def _refusal(root: Path, path: Path, record: dict, why: str) -> CheckpointLockError:
    if "unreadable" in record:
        return CheckpointLockError(
            f"checkpoint directory {root} is locked by another run (lock file {path}; "
            f"{record['unreadable']}): wait for that run or set another checkpoint.save; if no "
            f"run writes to {root}, delete {path}")
    return CheckpointLockError(
        f"checkpoint directory {root} is in use by another run ({_holder(record)}; {why}): one "
        f"run writes to a checkpoint directory at a time; wait for it to finish or set another "
        f"checkpoint.save")


def _watch(path: Path, record: dict, stale_s: float | None) -> tuple[dict | None, _Verdict]:
    """Watch an undecided holder's lock until it is live (its heartbeat or file changed), gone
    (the heartbeat grew too old), or the file is replaced or removed (returns its new record)."""
    if stale_s is None:
        return record, _Verdict("live", "it runs on another host and checkpoint.lock_stale_s "
                                        "is null (a foreign lock is never taken over)")
    poll = min(1.0, heartbeat_interval(stale_s) / 2)
    while True:
        time.sleep(poll)
        now = _read_holder(path)
        if now is None or now.get("token") != record.get("token"):
            return now, _Verdict("undecided", "the lock file changed")
        if now.get("heartbeat") != record.get("heartbeat") or (
                "unreadable" in record and now.get("_mtime") != record.get("_mtime")):
            if "unreadable" in now:
                record = now
                continue
            return now, _Verdict("live", "its heartbeat advanced while this run waited")
        verdict = _judge(now, stale_s)
        if verdict.state != "undecided":
            return now, verdict


def _take_over(path: Path, record: dict) -> bool:
    """Remove the lock file judged gone, if it is still that one (atomic against other runs
    doing the same): rename it aside, compare, and put back a file that turned out newer."""
    aside = path.with_name(f"{LOCK_NAME}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # someone else removed or renamed it: look again
    moved = _read_holder(aside) or {}
    same = (moved.get("token") == record.get("token")
            and moved.get("unreadable") == record.get("unreadable"))
    if not same:
        # Another run took the lock between our reading and our rename: give it back (link
        # fails if yet another run created one meanwhile; that holder then notices its loss).
        try:
            os.link(aside, path)
        except OSError:
            pass
    aside.unlink(missing_ok=True)
    return same


def check(lock: CheckpointLock | None) -> str | None:
    """Why ``lock`` is no longer this run's: its file was deleted or replaced (taken over by a
    run that judged this one gone); None while it holds, or for no lock. Sets ``lock.lost``."""
    if lock is None or lock.lost is not None or lock._fd is None:
        return None if lock is None else lock.lost
    try:
        there = os.stat(lock.path).st_ino
    except FileNotFoundError:
        there = None
    except OSError:
        return None  # a passing file-system error is no proof of a takeover
    if there != os.fstat(lock._fd).st_ino:
        lock.lost = (f"the lock file {lock.path} was "
                     f"{'deleted' if there is None else 'taken over by another run'}")
    return lock.lost


def _beat(lock: CheckpointLock) -> None:
    """The heartbeat thread: rewrite the record's heartbeat in place, while the file is ours."""
    warned = False
    while not lock._stop.wait(lock.heartbeat_s):
        try:
            if check(lock) is not None:
                return
            lock._record["heartbeat"] = _timestamp(_now())
            os.pwrite(lock._fd, json.dumps(lock._record).encode(), 0)
            os.fsync(lock._fd)
        except OSError as err:
            if not warned:  # a passing file-system error; the next beat tries again
                print(f"warning: could not refresh the heartbeat of {lock.path}: {err}",
                      file=sys.stderr, flush=True)
                warned = True


def acquire(root: str | os.PathLike, stale_s: float | None = 120.0,
            heartbeat: bool = True) -> tuple[CheckpointLock, str | None]:
    """Take the lock of ``root`` in this process (creating ``root`` if needed).

    Args:
        root: the checkpoint directory.
        stale_s: ``checkpoint.lock_stale_s``: a lock held on another machine whose heartbeat
            is older than this (and than two of its holder's heartbeat intervals) is taken
            over; None never takes over a lock held on another machine.
        heartbeat: start the heartbeat thread (every :func:`heartbeat_interval` seconds).

    Returns:
        The lock, and the line that says a gone holder's lock was taken over (None if not).

    Raises:
        CheckpointLockError: another run holds the lock (live), naming the directory and the
            holder's host, pid and start time; or a file without a record that is younger than
            the timeout (named as such).
        OSError: the directory or the lock file cannot be created (permissions, read-only).
    """
    root = Path(root)
    created_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    token = uuid.uuid4().hex
    interval = heartbeat_interval(stale_s)
    record = _holder_record(token, interval)
    taken_over = None
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            found = _read_holder(path)
            if found is None:
                continue  # released between our attempt and the read: try again
            verdict = _judge(found, stale_s)
            if verdict.state == "undecided":
                found, verdict = _watch(path, found, stale_s)
                if found is None or verdict.state == "undecided":
                    continue  # the file changed under us: judge the new one
            if verdict.state == "live":
                raise _refusal(root, path, found, verdict.why) from None
            if _take_over(path, found):
                what = ("a lock file without a record" if "unreadable" in found
                        else f"the lock of a run that is gone ({_holder(found)})")
                taken_over = (f"warning: checkpoint directory {root}: took over {what}: "
                              f"{verdict.why}; the run resumes from the newest verified "
                              "checkpoint there, if any")
            continue
        break
    try:
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    lock = CheckpointLock(path, token, created_root, interval if heartbeat else None,
                          _fd=fd, _record=record)
    if heartbeat:
        lock._thread = threading.Thread(target=_beat, args=(lock,), daemon=True,
                                        name="nemo_msa-checkpoint-lock-heartbeat")
        lock._thread.start()
    return lock, taken_over


def release(lock: CheckpointLock | None) -> None:
    """Stop the heartbeat and remove the lock file if it still holds this run's token; never
    raises."""
    if lock is None:
        return
    lock._stop.set()
    if lock._thread is not None:
        lock._thread.join()
    if lock._fd is not None:
        os.close(lock._fd)
        lock._fd = None
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


def _distributed() -> tuple[bool, int]:
    distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    return distributed, torch.distributed.get_rank() if distributed else 0


def acquire_on_rank0(root: str | os.PathLike | None,
                     stale_s: float | None = 120.0) -> CheckpointLock | None:
    """Rank 0 takes the lock of ``root``; every rank learns the outcome (collective).

    Every rank waits here until rank 0 holds the lock, so no rank reads the directory first. A
    takeover is announced by rank 0 in one line on stderr.

    Returns:
        The lock on rank 0, None on the other ranks and when ``root`` is None.

    Raises:
        CheckpointLockError: on every rank when rank 0 could not take it (same message).
    """
    if root is None:
        return None
    distributed, rank = _distributed()
    lock, failure = None, None
    if rank == 0:
        try:
            lock, taken_over = acquire(root, stale_s)
            if taken_over:
                print(taken_over, file=sys.stderr, flush=True)
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


__all__ = ["LOCK_NAME", "MAX_HEARTBEAT_S", "CheckpointLock", "CheckpointLockError", "acquire",
           "acquire_on_rank0", "check", "heartbeat_interval", "release"]
