"""Copies the block-sparse peers' wheel part carried in .peers/part* to /tmp/peer_parts, kept
while the machine is warm. The peers' wheels (FlashAttention-4, cuDNN-FE, nvidia-cutlass-dsl and
its 92 MB CUDA 13 library) are larger than one device call may carry:
benchmarks/peer_wheels.sh splits them here into .peers/part0 and .peers/part1 (docs/adr/0056),
and calls back to back on one warm machine carry one part each:

  carry [".peers/part0", ".whl"]:
      python3 -m benchmarks.device peer_part; python3 -m benchmarks.device sparse_peers \\
        --args='--peers none'
  carry [".peers/part1", ".whl"]:
      python3 -m benchmarks.device peer_part; python3 -m benchmarks.device sparse_peers \\
        --args='--tokens 8192,32768'
  carry [".whl"]:  python3 -m benchmarks.device sparse_peers --args='--tokens 131072'

Prints the parts the destination holds.
"""

from __future__ import annotations

import shutil

from .. import options

NAME = "peer_part"
HELP = "copy the carried block-sparse peers' wheel part (.peers/part*) to /tmp/peer_parts"


def add_arguments(group) -> None:
    group.add_argument("--parts", type=options.path, default=".peers",
                       help="the folder holding the carried part<N> folders")
    group.add_argument("--dest", type=options.path, default="/tmp/peer_parts",
                       help="where the parts gather across the calls of one warm machine")


def run(args, ctx) -> dict | None:
    parts = ctx.glob(args.parts, "part*/*")

    def copy() -> None:
        args.dest.mkdir(parents=True, exist_ok=True)
        for part in parts:
            shutil.copy(part, args.dest / part.name)

    ctx.do(f"copy {args.parts}/part*/* to {args.dest}/", copy)
    if ctx.dry:
        return None
    held = {p.name: p.stat().st_size for p in sorted(args.dest.iterdir())}
    print("\n".join(f"{size:>12} {name}" for name, size in held.items()))
    return {"copied": [p.name for p in parts], "held": held}
