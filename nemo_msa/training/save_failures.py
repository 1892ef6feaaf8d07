"""Why a checkpoint save failed, in one line: the OSError behind it, found through Megatron.

A save that hits a full disk (or a quota, a permission, an I/O error) must say so by path and
cause, on every rank, and leave the previous checkpoint as it was
(:func:`nemo_msa.training.checkpoint.save_checkpoint`). Megatron's dist-checkpointing hides the
cause: its writer threads catch the OSError, log its text and hand on a RuntimeError("Worker
failure: ... <class 'OSError'>") inside torch's CheckpointException; errors from other ranks
arrive pickled, as text. :func:`os_error_in` looks in all of these and in the writer's log.
torch's zip writer (``torch.save`` into the checkpoint's files) reports a write that the file
system cut short with no errno at all ("[enforce fail at inline_container.cc:672] . unexpected
pos 704 vs 598"): :func:`short_write_in` recognizes it, and the message then says what limits
writing there (the process's file size limit, the free space) so that the cause can be named.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import resource
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from nemo_msa.training.checkpoint_integrity import POINTER, checkpoint_name


class WriterLog(logging.Handler):
    """Collects the messages dist-checkpointing's file writer logs while it saves.

    Its writer threads catch the OSError of a failed write, log its text ("Local worker 0
    encountered an error: [Errno 28] No space left on device") and hand on only an exception
    that says ``<class 'OSError'>``; the log record is where the cause survives.
    """

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^\n]*?)(?::\s*'([^']*)')?\s*$", re.M)


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception, its causes and contexts, and the per-rank failures of torch's
    CheckpointException (as text when pickled from another rank), breadth first."""
    seen, todo, found = set(), [exc], []
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return found


def os_error_in(exc: BaseException, log: list[str]) -> tuple[int | None, str, str | None] | None:
    """The OSError behind a failed save: ``(errno, message, filename)``, or None.

    Looked for in the exception, its causes and contexts, the per-rank failures of torch's
    CheckpointException, the errno texts these carry (an exception pickled across ranks keeps
    only its text), then in the writer's log messages.
    """
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, OSError):
            return e.errno, e.strerror or str(e), e.filename
    for text in [*map(str, chain), *log]:
        m = _ERRNO_TEXT.search(text)
        if m:
            return int(m.group(1)), m.group(2).strip(), m.group(3)
    return None


#: torch's zip writer (caffe2's inline_container.cc) when the file took fewer bytes than it
#: wrote: a full disk, a quota or a file size limit, with the errno lost on the way.
_SHORT_WRITE = re.compile(r"\[enforce fail at inline_container\.cc:\d+\][ .]*"
                          r"(unexpected pos \d+ vs \d+|PytorchStreamWriter failed [^\n]*)")


def short_write_in(exc: BaseException, log: list[str]) -> str | None:
    """torch's zip-writer text of a write the file system cut short, or None.

    Looked for where :func:`os_error_in` looks; Megatron's wrapper ("Worker failure: ...
    <class 'RuntimeError'>") leaves the only copy of the text in the writer's log.
    """
    for text in [*map(str, _chain(exc)), *log]:
        m = _SHORT_WRITE.search(text)
        if m:
            return m.group(0).strip()
    return None


def _size(n: int) -> str:
    """A byte count in words: bytes below 1 KiB, else KiB, MiB or GiB with one decimal."""
    if n < 1024:
        return f"{n} bytes"
    exponent = min(3, (n.bit_length() - 1) // 10)
    return f"{n / 1024 ** exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def write_limits(where: Path) -> str:
    """What limits writing under ``where``: this process's file size limit (when set) and the
    free space of its file system, in words."""
    facts = []
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        facts.append(f"this process may write files of at most {soft} bytes (RLIMIT_FSIZE, "
                     "`ulimit -f`)")
    probe = Path(where)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
        facts.append(f"{_size(st.f_bavail * st.f_frsize)} free on the file system of {probe}")
    except OSError:
        pass
    return "; ".join(facts)


def previous_checkpoint(root: Path) -> str:
    """What a failed save leaves to resume from, in words (rank 0's view)."""
    try:
        text = (root / POINTER).read_text().strip()
        return (f"the previous checkpoint ({checkpoint_name(root, int(text))}) and {POINTER} "
                "are unchanged; the run resumes from it")
    except (OSError, ValueError):
        return f"no earlier checkpoint is in {root} ({POINTER} is absent or unreadable)"


def attempt_save_step(action, where: Path, log: list[str]) -> str | None:
    """Run one step of a save; an OSError (also one wrapped by Megatron) becomes its description,
    anything else propagates."""
    try:
        action()
    except (Exception, CheckpointException) as exc:
        found = os_error_in(exc, log)
        if found is None:
            short = short_write_in(exc, log)
            if short is None:
                for message in log:
                    exc.add_note(f"dist-checkpointing's writer logged: {message}")
                raise
            return (f"the file system took fewer bytes than were written (torch's zip writer: "
                    f"{short}; a full disk, a quota or a file size limit) writing {where} "
                    f"({write_limits(where)})")
        code, message, filename = found
        name = errno.errorcode.get(code, "") if code is not None else ""
        limits = f" ({write_limits(where)})" if code == errno.EFBIG else ""
        return (f"{message} ({'errno ' + str(code) if code is not None else 'OSError'}"
                f"{' ' + name if name else ''}) writing {filename or where}{limits}")
    return None


def agree_on_failure(failure: str | None) -> str | None:
    """The first rank's failure on every rank (collective; the save's barrier)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return failure
    every: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, failure)
    return next((f for f in every if f is not None), None)


def agreed_save_step(action, where: Path, log: list[str], runs_here: bool
                     ) -> tuple[str | None, Exception | None]:
    """One step of a save on the ranks it runs on, then the first failure on every rank
    (collective).

    A failure that is not a file-system one (:func:`attempt_save_step` re-raises it) is agreed
    on too, as ``rank R: Type: message``, so that the other ranks stop instead of waiting for
    this one at the agreement until the process group's timeout.

    Args:
        action: the step.
        where: the path the step writes (for the failure's description).
        log: dist-checkpointing's writer lines, quoted by the description.
        runs_here: this rank runs the step (rank 0 alone runs the steps on shared paths).

    Returns:
        ``(failure, error)``: the agreed failure's description (None where every rank
        succeeded), and this rank's own unrecognized exception, which the caller re-raises after
        it has cleaned up (None where there was none).
    """
    failure = error = None
    if runs_here:
        try:
            failure = attempt_save_step(action, where, log)
        except Exception as exc:  # noqa: BLE001 - agreed on below, then raised by the caller
            error = exc
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            failure = f"rank {rank}: {type(exc).__name__}: {exc}"
    return agree_on_failure(failure), error


__all__ = ["WriterLog", "agree_on_failure", "agreed_save_step", "attempt_save_step",
           "os_error_in", "previous_checkpoint", "short_write_in", "write_limits"]
