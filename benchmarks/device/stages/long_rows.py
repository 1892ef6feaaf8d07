"""Issue 63's long rows (ADR 0051): one training step of a one-layer MiniMax-M3-shaped
GPTModel with an MSA layer (sparse indexer loss, one document; benchmarks/bench_layer.py) at
--tokens, then the search for the longest one-document row that fits the card (bench_layer.py
--grow-to: doubling up to --grow-to tokens, then halving the gap to 16384 tokens), timed by the
median of 2 steps after 1 warm-up step. A row that runs out of memory is a row of the table
(status oom), not a failure. The default suits an H200; on an H100, where 262144 tokens are
expected not to fit (about 83 GiB), give --tokens 131072,262144 --grow-to 524288: the search
then halves the gap between the two.

Writes long.json (its "longest" gives the longest row with its peak memory and step time, and
the shortest that failed) and long.log (with "rc N"), and prints the search's result and the
table.
"""

from __future__ import annotations

from .. import options
from ..tools import bench_layer, layer_table

NAME = "long_rows"
HELP = "one layer's MSA step from 262144 tokens and the longest row that fits (--grow-to)"


def add_arguments(group) -> None:
    options.add_rows(group, "262144")
    group.add_argument("--grow-to", type=options.count, default=1048576,
                       help="the longest row the search tries (tokens)")
    options.add_bound(group, 400.0)
    options.add_args(group, "bench_layer.py", "--cases dense,msa_sparse_loss")


def run(args, ctx) -> dict | None:
    log = ctx.out / "long.log"
    ctx.say(f"== long_rows: benchmarks/bench_layer.py --tokens {args.tokens} --grow-to "
            f"{args.grow_to}", log, new=True)
    rc = ctx.run(bench_layer("--tokens", args.tokens, "--cases", "msa_sparse_loss",
                             "--no-attention-rows", "--no-pair-rate", "--grow-to",
                             str(args.grow_to), "--steps", "2", "--warmup", "1", "--json",
                             ctx.out / "long.json", *args.args, log=log, seconds=args.seconds))
    ctx.note(f"rc {rc}", log)
    if ctx.dry:
        return None
    found = [line for line in log.read_text(errors="replace").splitlines()
             if "longest row that ran" in line]
    print("\n".join(found + [layer_table(log)]), flush=True)
    return {"status": rc, "longest": found}
