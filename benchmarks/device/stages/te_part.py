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

from . import _parts

NAME = "te_part"
HELP = "copy the carried Transformer Engine wheel part (.te/part*) to /tmp/te"


def add_arguments(group) -> None:
    _parts.add_arguments(group, ".te", "/tmp/te")


def run(args, ctx) -> dict | None:
    return _parts.gather(args, ctx)
