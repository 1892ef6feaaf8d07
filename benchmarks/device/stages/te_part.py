"""Copies the Transformer Engine core-wheel part carried in .te/part* to /tmp/te, kept while the
machine is warm. TE's core wheel (276.5 MB) is larger than one device call may carry:
benchmarks/te_parts.sh splits it here into .te/part0 .. .te/part4 and a kit (.te/kit, from
../shared/te), and five calls back to back on one warm machine carry one part each:

  carry [".te/part0"]:  python3 -m benchmarks.device te_part
  ... part1, part2, part3 the same ...
  carry [".te/part4", ".te/kit", ".whl"]:
      python3 -m benchmarks.device te_part; python3 -m benchmarks.device te

Prints the parts the destination holds.
"""

from __future__ import annotations

import shutil

from .. import options

NAME = "te_part"
HELP = "copy the carried Transformer Engine wheel part (.te/part*) to /tmp/te"


def add_arguments(group) -> None:
    group.add_argument("--parts", type=options.path, default=".te",
                       help="the folder holding the carried part<N> folders")
    group.add_argument("--dest", type=options.path, default="/tmp/te",
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
