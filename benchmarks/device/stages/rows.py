"""Issue #28's rows (one training step of a one-layer MiniMax-M3-shaped GPTModel,
benchmarks/bench_layer.py), dense and MSA in one process with the untrained indexer's random
selections, then both again with coherent, trained-like ones (--index coherent, ADR 0031): each
ratio is against the dense step of its own process.

Writes rows_fresh.json / rows_coherent.json and their logs (with "rc N"), and prints each table.
"""

from __future__ import annotations

from .. import options
from ..tools import ISSUE_ROWS, ROW_TIMING, bench_layer, layer_table

NAME = "rows"
HELP = "issue #28's five layer rows, dense and MSA, with fresh and with coherent selections"


def add_arguments(group) -> None:
    options.add_rows(group, ISSUE_ROWS)
    options.add_bound(group, 270.0, "each process's bound")
    options.add_args(group, "bench_layer.py")


def run(args, ctx) -> None:
    cases = "dense,msa_sparse_loss"
    for index in ("fresh", "coherent"):
        log = ctx.out / f"rows_{index}.log"
        ctx.say(f"== rows ({index}): benchmarks/bench_layer.py --tokens {args.tokens} "
                f"--cases {cases}", log, new=True)
        rc = ctx.run(bench_layer("--tokens", args.tokens, "--cases", cases, "--index", index,
                                 *ROW_TIMING, "--json", ctx.out / f"rows_{index}.json",
                                 *args.args, log=log, seconds=args.seconds))
        ctx.note(f"rc {rc}", log)
        if not ctx.dry:
            print(layer_table(log))
