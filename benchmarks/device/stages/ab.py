"""Kernels timed before and after a change in one call: for each --run argument list,
benchmarks/bench_msa.py runs first in the base tree (carried as .base: git archive BASE | tar -x
-C .base; echo BASE > .base/.commit), then in this tree.

Writes ab.log, every run under its "== ab <n> base|head: ..." header with its "rc N", and prints
each run's table rows (or its end).
"""

from __future__ import annotations

from .. import options
from ..record import tree_commit
from ..runner import ROOT, StageError
from .bench import add_runs, bench_msa_logged

NAME = "ab"
HELP = "benchmarks/bench_msa.py in a carried base tree (.base) and then in this one"
DEFAULT_RUN = "--sizes 8192,32768 --packed 32768 --no-dense"


def add_arguments(group) -> None:
    group.add_argument("--base", type=options.path, default=".base",
                       help="the base commit's tree (carried)")
    add_runs(group, DEFAULT_RUN)
    options.add_bound(group, 200.0, "each run's bound (base and head each)")


def run(args, ctx) -> None:
    log = ctx.out / "ab.log"
    script = args.base / "benchmarks" / "bench_msa.py"
    if not ctx.when(f"{script} exists", script.is_file):
        ctx.note(f"== ab: no {script}", log, new=True)
        raise StageError(f"--base {args.base}: no {script}; carry the base commit's tree there")
    commit = tree_commit(args.base, f"tree {args.base}")
    for n, run_args in enumerate(args.run or [options.words(DEFAULT_RUN)], 1):
        for side, tree in (("base", args.base), ("head", ROOT)):
            bench_msa_logged(ctx, f"== ab {n} {side}: benchmarks/bench_msa.py "
                             f"{' '.join(run_args)}", tree, args.seconds, log, run_args, commit)
