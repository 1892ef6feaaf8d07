"""benchmarks/bench_msa.py (the Triton selection and attention against float64 for correctness
and against cuDNN SDPA for time), once per --run argument list.

Writes bench.log, every run under its "== bench <n>: ..." header with its "rc N" (one file: the
device tool returns only a few), and prints each run's table rows (or its end).
"""

from __future__ import annotations

from pathlib import Path

from .. import options
from ..runner import ROOT, python

NAME = "bench"
HELP = "benchmarks/bench_msa.py runs (kernel correctness against float64, time against cuDNN)"
DEFAULT_RUN = "--sizes 131072 --packed 0"


def add_runs(group, default: str) -> None:
    """``--run``: one bench_msa.py argument list, repeated for more."""
    group.add_argument("--run", type=options.words, action="append", default=None,
                       metavar="ARGS", help="one run's bench_msa.py arguments; repeat the "
                       f"option for more (default: one run, '{default}') {options.WORDS_HELP}")


def add_arguments(group) -> None:
    add_runs(group, DEFAULT_RUN)
    options.add_bound(group, 300.0, "each run's bound")


def bench_msa_logged(ctx, header: str, tree: Path, seconds: float, log: Path, args: list[str],
                     commit: str | None = None) -> int:
    """One bench_msa.py run of ``tree`` (its package on PYTHONPATH, at ``commit``), bounded by
    ``seconds``, its output appended to ``log`` under ``header``; prints its table rows (or its
    end)."""
    start = log.stat().st_size if log.exists() else 0
    ctx.say(header, log)
    rc = ctx.run(python("benchmarks/bench_msa.py", *args, cwd=tree, log=log, seconds=seconds,
                        env={} if tree == ROOT else ctx.tree_env(tree, commit)))
    ctx.note(f"rc {rc}", log)
    if not ctx.dry:
        with open(log, "rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()[1:]
        rows = [line for line in lines
                if line.startswith(("| doc", "| packed", "rc ")) or "Error" in line]
        print("\n".join(rows or lines[-5:]))
    return rc


def run(args, ctx) -> None:
    for n, run_args in enumerate(args.run or [options.words(DEFAULT_RUN)], 1):
        bench_msa_logged(ctx, f"== bench {n}: benchmarks/bench_msa.py {' '.join(run_args)}", ROOT,
                         args.seconds, ctx.out / "bench.log", run_args)
