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

from . import _parts

NAME = "peer_part"
HELP = "copy the carried block-sparse peers' wheel part (.peers/part*) to /tmp/peer_parts"


def add_arguments(group) -> None:
    _parts.add_arguments(group, ".peers", "/tmp/peer_parts")


def run(args, ctx) -> dict | None:
    return _parts.gather(args, ctx)
