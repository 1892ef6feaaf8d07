"""What the stages that gather carried parts share (``te_part``, ``peer_part``): a payload
larger than one device call travels in parts, one per call, and gathers in a folder the warm
machine keeps between calls."""

from __future__ import annotations

import shutil

from .. import options


def add_arguments(group, parts: str, dest: str) -> None:
    """``--parts`` (the carried ``part<N>`` folders) and ``--dest`` (where they gather)."""
    group.add_argument("--parts", type=options.path, default=parts,
                       help="the folder holding the carried part<N> folders")
    group.add_argument("--dest", type=options.path, default=dest,
                       help="where the parts gather across the calls of one warm machine")


def gather(args, ctx) -> dict | None:
    """Copies ``--parts``/part*/* to ``--dest`` and prints what it holds; the summary."""
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
