"""The layer rows with the Transformer Engine spec (benchmarks/bench_layer.py
--transformer-impl transformer_engine), in bf16 and then with FP8 GEMMs, dense and MSA (sparse
loss), one process per precision. Needs TE installed (te_part, te).

Writes te_rows_bf16.json / te_rows_fp8.json and their logs (with "rc N"), and prints each table.
"""

from __future__ import annotations

from .. import options
from ..tools import ROW_TIMING, bench_layer, layer_table

NAME = "te_rows"
HELP = "the layer rows with the TE spec, in bf16 and with FP8 GEMMs"


def add_arguments(group) -> None:
    options.add_rows(group, "8192,32768,131072,32768:4096,131072:16384")
    group.add_argument("--fp8", choices=("hybrid", "e4m3"), default="hybrid",
                       help="the FP8 format of the second process")
    options.add_bound(group, 270.0, "each precision's bound")
    options.add_args(group, "bench_layer.py", "--m3-block --experts 16")


def run(args, ctx) -> None:
    for precision, fp8 in (("bf16", ()), ("fp8", ("--fp8", args.fp8))):
        log = ctx.out / f"te_rows_{precision}.log"
        impl = ("--transformer-impl", "transformer_engine", *fp8)
        ctx.say(f"== te_rows ({precision}): benchmarks/bench_layer.py {' '.join(impl)}", log,
                new=True)
        rc = ctx.run(bench_layer(*impl, "--tokens", args.tokens, "--cases",
                                 "dense,msa_sparse_loss", *ROW_TIMING, "--json",
                                 ctx.out / f"te_rows_{precision}.json", *args.args, log=log,
                                 seconds=args.seconds))
        ctx.note(f"rc {rc}", log)
        if not ctx.dry:
            print(layer_table(log, errors=True))
