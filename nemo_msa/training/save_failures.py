"""Why a checkpoint save failed, in one line: the OSError behind it, found through Megatron.

A save that hits a full disk (or a quota, a permission, an I/O error) must say so by path and
cause, on every rank, and leave the previous checkpoint as it was
(:func:`nemo_msa.training.checkpoint.save_checkpoint`). Megatron's dist-checkpointing hides the
cause: its writer threads catch the OSError, log its text and hand on a RuntimeError("Worker
failure: ... <class 'OSError'>") inside torch's CheckpointException; errors from other ranks
arrive pickled, as text. :func:`os_error_in` looks in all of these and in the writer's log.
"""

from __future__ import annotations

import errno
import logging
import re
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


def os_error_in(exc: BaseException, log: list[str]) -> tuple[int | None, str, str | None] | None:
    """The OSError behind a failed save: ``(errno, message, filename)``, or None.

    Looked for in the exception, its causes and contexts, the per-rank failures of torch's
    CheckpointException, the errno texts these carry (an exception pickled across ranks keeps
    only its text), then in the writer's log messages.
    """
    seen, todo, texts = set(), [exc], []
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e.errno, e.strerror or str(e), e.filename
        texts.append(str(e))
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    for text in [*texts, *log]:
        m = _ERRNO_TEXT.search(text)
        if m:
            return int(m.group(1)), m.group(2).strip(), m.group(3)
    return None


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
            raise
        code, message, filename = found
        name = errno.errorcode.get(code, "") if code is not None else ""
        return (f"{message} ({'errno ' + str(code) if code is not None else 'OSError'}"
                f"{' ' + name if name else ''}) writing {filename or where}")
    return None


def agree_on_failure(failure: str | None) -> str | None:
    """The first rank's failure on every rank (collective; the save's barrier)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return failure
    every: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, failure)
    return next((f for f in every if f is not None), None)


__all__ = ["WriterLog", "agree_on_failure", "attempt_save_step", "os_error_in",
           "previous_checkpoint"]
