"""benchmarks/bench_layer.py with the arguments given: a one-layer MiniMax-M3 GPTModel training
step, dense vs MSA, plus the dense_attention / cudnn_attention rows (its own defaults unless
--args says otherwise; benchmarks/README.md lists its options).

Writes layer.json and layer.log (with "rc N") and prints its table (every case row and the two
attention rows), or its rows and the log's end.
"""

from __future__ import annotations

from .. import options
from ..tools import bench_layer, layer_table

NAME = "layer"
HELP = "benchmarks/bench_layer.py with the arguments given (dense vs MSA layer step)"


def add_arguments(group) -> None:
    options.add_args(group, "bench_layer.py", "--tokens 8192 --cases dense,msa_sparse_loss")
    options.add_bound(group, 540.0)


def run(args, ctx) -> None:
    log = ctx.out / "layer.log"
    ctx.say(f"== layer: benchmarks/bench_layer.py {' '.join(args.args)}", log, new=True)
    rc = ctx.run(bench_layer(*args.args, "--json", ctx.out / "layer.json", log=log,
                             seconds=args.seconds))
    ctx.note(f"rc {rc}", log)
    if not ctx.dry:
        print(layer_table(log))
