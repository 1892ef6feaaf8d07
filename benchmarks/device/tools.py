"""The benchmark scripts as the stages run them: their command lines and what of their logs is
printed."""

from __future__ import annotations

from pathlib import Path

from .runner import ROOT, Command, python, table_or_tail

#: Issue #28's five rows: three one-document rows and two packed ones.
ISSUE_ROWS = "8192,32768,32768:4096,131072:16384,131072"
#: The timing every stage of whole rows uses (medians of 3 steps after 2 warm-up steps).
ROW_TIMING = ("--no-attention-rows", "--steps", "3", "--warmup", "2")


def bench_layer(*args: str | Path, tree: Path = ROOT, **kwargs) -> Command:
    """``benchmarks/bench_layer.py args`` in ``tree`` (its own scripts and package)."""
    return python("benchmarks/bench_layer.py", *args, cwd=tree, **kwargs)


def layer_table(log: Path, errors: bool = False) -> str:
    """bench_layer.py's table from its log or, where it printed none, its JSON rows (and its
    errors where ``errors``) and its last lines."""
    return table_or_tail(
        log,
        "|  tokens |",
        lambda line: line.startswith('{"tokens"') or (errors and "Error" in line),
    )


def peer_table(log: Path, header: str) -> str:
    """A peer benchmark's table and notes or, where it printed none, what says why and the log's
    end."""
    return table_or_tail(
        log,
        header,
        lambda line: "FAILED" in line or "cannot import" in line or line.startswith("rc "),
    )
