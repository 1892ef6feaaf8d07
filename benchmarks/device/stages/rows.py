"""Issue #28's rows (one training step of a one-layer MiniMax-M3-shaped GPTModel,
benchmarks/bench_layer.py), dense and MSA in one process per selection regime (--index): the
untrained indexer's random selections (fresh), block-shared ones (coherent, ADR 0031) and ones
with a trained indexer's tile unions (trained): each ratio is against the dense step of its own
process.

Writes rows_<regime>.json and its log (with "rc N") per regime, and prints each table.
"""

from __future__ import annotations

import argparse

from .. import options
from ..tools import ISSUE_ROWS, ROW_TIMING, bench_layer, layer_table

NAME = "rows"
HELP = "issue #28's five layer rows, dense and MSA, per selection regime (fresh, coherent, trained)"
REGIMES = ("fresh", "coherent", "trained")


def _regimes(text: str) -> list[str]:
    """``--regimes``: a comma-separated list out of :data:`REGIMES`."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in items if item not in REGIMES]
    if not items or bad:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated list of {', '.join(REGIMES)}")
    return items


def add_arguments(group) -> None:
    options.add_rows(group, ISSUE_ROWS)
    group.add_argument("--regimes", type=_regimes, default=["fresh", "coherent"],
                       help="selection regimes, one process each (bench_layer.py --index; "
                       "default fresh,coherent)")
    options.add_bound(group, 270.0, "each process's bound")
    options.add_args(group, "bench_layer.py")


def run(args, ctx) -> None:
    cases = "dense,msa_sparse_loss"
    for index in args.regimes:
        log = ctx.out / f"rows_{index}.log"
        ctx.say(f"== rows ({index}): benchmarks/bench_layer.py --tokens {args.tokens} "
                f"--cases {cases}", log, new=True)
        rc = ctx.run(bench_layer("--tokens", args.tokens, "--cases", cases, "--index", index,
                                 *ROW_TIMING, "--json", ctx.out / f"rows_{index}.json",
                                 *args.args, log=log, seconds=args.seconds))
        ctx.note(f"rc {rc}", log)
        if not ctx.dry:
            print(layer_table(log))
