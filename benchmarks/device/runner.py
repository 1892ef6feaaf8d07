"""How a stage runs its commands: each one bounded in time, its output in a log under the output
folder, its exit status and duration in the stage's record; or, with ``--dry-run``, each printed
as the shell line that would run it, and nothing run or written.

A bound works as coreutils ``timeout -k 30`` did in the shell script this replaced: the command
runs in its own process group, with SIGINT's default action even where this process ignores it;
when the bound passes the group gets SIGTERM (SIGINT for pytest, which then still prints its
counts), SIGKILL 30 s later if it has not ended, and the status is 124 (137 where it had to be
killed).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: The repository root: commands run here unless they name another tree.
ROOT = Path(__file__).resolve().parents[2]
#: Seconds between a bound's first signal and SIGKILL.
KILL_AFTER_S = 30.0
#: This interpreter runs every Python command (the device's python3; the tests' venv here).
PYTHON = sys.executable


class StageError(Exception):
    """A stage cannot run as asked (a missing input); the message names the option and what
    was expected."""


@dataclass(frozen=True)
class Command:
    """One command of a stage.

    Attributes:
        argv: the program and its arguments.
        log: where its stdout and stderr are appended; None: this process's stdout.
        seconds: its bound; None: unbounded.
        interrupt: the bound sends SIGINT first (pytest then prints its counts), else SIGTERM.
        cwd: where it runs (the repository root, or another tree for ``ab`` and ``sweep``).
        env: variables on top of the stage's environment.
        question: its exit status answers a question (is every arm done?); a non-zero one is
            not a failure of the stage.
    """

    argv: tuple[str, ...]
    log: Path | None = None
    seconds: float | None = None
    interrupt: bool = False
    cwd: Path = ROOT
    env: Mapping[str, str] = field(default_factory=dict)
    question: bool = False

    def shell_line(self) -> str:
        """The shell line that runs this command as :meth:`Context.run` does."""
        parts = [f"cd {shlex.quote(str(self.cwd))} &&"] if self.cwd != ROOT else []
        parts += [f"{key}={shlex.quote(value)}" for key, value in self.env.items()]
        if self.seconds is not None:
            parts += ["timeout"] + (["-s", "INT"] if self.interrupt else [])
            parts += ["-k", f"{KILL_AFTER_S:g}", f"{self.seconds:g}"]
        parts.append(shlex.join(self.argv))
        if self.log is not None:
            parts.append(f">> {shlex.quote(str(self.log))} 2>&1")
        return " ".join(parts)


def python(*args: str | Path, **kwargs) -> Command:
    """A :class:`Command` running ``args`` with this interpreter."""
    return Command(argv=(PYTHON, *map(str, args)), **kwargs)


class _Running:
    """A started command and its bound."""

    def __init__(self, command: Command, env: Mapping[str, str]):
        self.command = command
        self.started = time.monotonic()
        self.deadline = None if command.seconds is None else self.started + command.seconds
        self.kill_at: float | None = None
        self.status: int | None = None
        out = None
        if command.log is not None:
            command.log.parent.mkdir(parents=True, exist_ok=True)
            out = open(command.log, "ab")  # closed in poll() or stop()
        self._out = out
        sys.stdout.flush()
        self.proc = subprocess.Popen(
            command.argv,
            cwd=command.cwd,
            env={**env, **command.env},
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )

    def poll(self) -> int | None:
        """The exit status once ended (124/137 where the bound stopped it), else None."""
        if self.status is not None:
            return self.status
        rc = self.proc.poll()
        now = time.monotonic()
        if rc is None and self.deadline is not None and now >= self.deadline:
            if self.kill_at is None:
                first = signal.SIGINT if self.command.interrupt else signal.SIGTERM
                self._signal(first)
                self.kill_at = now + KILL_AFTER_S
            elif now >= self.kill_at:
                self._signal(signal.SIGKILL)
                self.kill_at = float("inf")
            return None
        if rc is None:
            return None
        if self.kill_at is not None:
            rc = 137 if self.kill_at == float("inf") else 124
        self.status = rc
        if self._out is not None:
            self._out.close()
        return rc

    def stop(self) -> None:
        """Kills the command's process group (the stage was interrupted)."""
        if self.proc.poll() is None:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        if self._out is not None:
            self._out.close()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class Context:
    """What a stage runs its commands and file operations through.

    Args:
        out: the output folder (absolute).
        env: the environment of every command (``PYTHONPATH`` with the wheels' site and this
            tree, ``PYTHONUNBUFFERED=1``, ``NEMO_MSA_COMMIT``).
        dry: print each command's shell line and each file operation, run and write nothing.
        site: the wheels' install folder where it is on ``PYTHONPATH`` (another tree's commands
            get it too), else None.
    """

    def __init__(
        self, out: Path, env: Mapping[str, str], dry: bool = False, site: Path | None = None
    ):
        self.out = out
        self.env = dict(env)
        self.dry = dry
        self.site = site
        #: Each command run: its shell line, exit status, seconds and log.
        self.steps: list[dict] = []

    def run(self, command: Command) -> int:
        """Runs ``command`` to its end or its bound; its exit status (0 in a dry run)."""
        if self.dry:
            print(command.shell_line(), flush=True)
            return 0
        return self.wait([self.start(command)])[0]

    def start(self, command: Command) -> _Running | None:
        """Starts ``command``, to be waited for with :meth:`wait` (the commands started before
        it run at the same time); a dry run prints its shell line with ``&``."""
        if self.dry:
            print(f"{command.shell_line()} &", flush=True)
            return None
        return _Running(command, self.env)

    def wait(self, running: list[_Running | None]) -> list[int]:
        """Waits for every started command, each to its own bound; their exit statuses."""
        if self.dry:
            print("wait", flush=True)
            return [0] * len(running)
        try:
            while any(r.poll() is None for r in running):
                time.sleep(0.1)
        except BaseException:
            for r in running:
                r.stop()
            raise
        for r in running:
            self.steps.append(
                {
                    "command": r.command.shell_line(),
                    "rc": r.status,
                    "seconds": round(time.monotonic() - r.started, 1),
                    "log": None if r.command.log is None else str(r.command.log),
                    "question": r.command.question,
                }
            )
        return [r.status for r in running]

    def tree_env(self, tree: Path, commit: str) -> dict[str, str]:
        """The variables that make a command run another tree's package (``tree``, at
        ``commit``) instead of this one's."""
        path = ([str(self.site)] if self.site is not None else []) + [str(tree)]
        return {"PYTHONPATH": os.pathsep.join(path), "NEMO_MSA_COMMIT": commit}

    def say(self, text: str, log: Path | None = None, new: bool = False) -> None:
        """Prints ``text`` and writes it to ``log`` (a new file where ``new``); not in a dry run."""
        if self.dry:
            return
        print(text, flush=True)
        if log is not None:
            write(log, text + "\n", new)

    def note(self, text: str, log: Path, new: bool = False) -> None:
        """Writes ``text`` and a newline to ``log`` only (a new file where ``new``; an empty one
        where ``text`` is empty too); not in a dry run."""
        if not self.dry:
            write(log, text + "\n" if text else "", new)

    def do(self, what: str, action: Callable[[], object]) -> None:
        """Runs ``action`` (a file operation); in a dry run prints ``# what`` instead."""
        if self.dry:
            print(f"# {what}", flush=True)
        else:
            action()

    def when(self, condition: str, test: Callable[[], bool]) -> bool:
        """Whether ``test()`` holds; a dry run prints ``# when <condition>:`` and says yes, so
        that the commands it guards are printed too."""
        if self.dry:
            print(f"# when {condition}:", flush=True)
            return True
        return test()

    def glob(self, folder: Path, pattern: str) -> list[Path]:
        """The files matching ``pattern`` in ``folder``, sorted; in a dry run, where they do not
        exist yet, one stand-in named by the pattern with ``<each>`` for its ``*``."""
        if self.dry:
            return [folder / pattern.replace("*", "<each>")]
        return sorted(folder.glob(pattern))


def write(path: Path, text: str, new: bool = False) -> None:
    """Appends ``text`` to ``path`` (creates it, and its folder; truncates it where ``new``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w" if new else "a") as f:
        f.write(text)


def table_or_tail(log: Path, header: str, fallback: Callable[[str], bool]) -> str:
    """``log`` from the first line starting with ``header`` on; where it printed no table, its
    lines for which ``fallback`` holds (cut to 300 characters) and its last 15 lines."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for i, line in enumerate(lines):
        if line.startswith(header):
            return "\n".join(lines[i:])
    return "\n".join([line[:300] for line in lines if fallback(line)] + lines[-15:])


def _default_sigint() -> None:
    # A process started with SIGINT ignored (a background job of a non-interactive shell) passes
    # the ignore on, and Python then raises no KeyboardInterrupt: the bound's SIGINT would not
    # stop pytest with its counts, only the SIGKILL after it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
