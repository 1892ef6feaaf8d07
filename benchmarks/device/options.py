"""The argument types and options the stages share: each type checks its value when the command
line is parsed, so a bad one stops the stage before anything runs, with the option, the value
and what was expected."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

_ROW = re.compile(r"[1-9][0-9]*(:[1-9][0-9]*)?")
_REGIME = re.compile(r"[1-9][0-9]*:[1-9][0-9]*")


def seconds(value: str) -> float:
    """A bound in seconds: a positive number."""
    try:
        parsed = float(value)
    except ValueError:
        parsed = float("nan")
    if not parsed > 0:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a positive number of seconds")
    return parsed


def seconds_above(margin: float):
    """A bound in seconds of more than ``margin`` (a script's budget is the bound minus it)."""

    def parse(value: str) -> float:
        parsed = seconds(value)
        if parsed <= margin:
            raise argparse.ArgumentTypeError(
                f"{value!r}: expected more than {margin:g} seconds (the script's budget is the "
                f"bound minus {margin:g})"
            )
        return parsed

    return parse


def count(value: str) -> int:
    """A positive integer."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a positive integer")
    return int(value)


def token_rows(value: str) -> str:
    """``bench_layer.py``'s ``--tokens``: comma-separated rows, each ``N`` (one document of N
    tokens) or ``N:MEAN`` (N tokens packed with documents of mean MEAN)."""
    if not all(_ROW.fullmatch(row) for row in value.split(",")):
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected comma-separated rows N or N:MEAN (positive integers), "
            "e.g. 8192,32768:4096"
        )
    return value


def regime(value: str) -> str:
    """``S:L``: the MSA arm trained at S tokens, evaluated at L."""
    if not _REGIME.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected TRAINED:EVALUATED token counts, e.g. 8192:8192"
        )
    return value


def words(value: str) -> list[str]:
    """A string of arguments for the program a stage runs, split as the shell would."""
    try:
        return shlex.split(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r}: {e}") from None


def path(value: str) -> Path:
    """A path, made absolute against the current folder (commands may run in another)."""
    return Path(value).expanduser().absolute()


#: The help of an option taking ``words``: a value starting with a dash needs the ``=`` form
#: where it has no space.
WORDS_HELP = "(one string, split as the shell would; write --opt='--flag' for a single flag)"


def add_bound(group, default: float, what: str = "the bound", above: float = 0.0) -> None:
    """``--seconds``: a command's bound (more than ``above`` where a script's budget is the
    bound minus it)."""
    group.add_argument("--seconds", type=seconds_above(above) if above else seconds,
                       default=default, help=what)


def add_args(group, script: str, example: str = "") -> None:
    """``--args``: more arguments for ``script``."""
    example = f", e.g. '{example}'" if example else ""
    group.add_argument("--args", type=words, default="",
                       help=f"more {script} arguments{example} {WORDS_HELP}")


def add_rows(group, default: str, flag: str = "--tokens") -> None:
    """bench_layer.py's rows."""
    group.add_argument(flag, type=token_rows, default=default,
                       help="the rows (N: one document; N:MEAN: packed documents of mean MEAN)")
