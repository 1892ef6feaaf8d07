#!/usr/bin/env python
"""The attention work of issue #28's rows, and the time it takes at the GPU's peak (CPU only).

For each row (``benchmarks/bench_layer.py``'s: ``N`` one document, ``N:MEAN`` packed with its
seeded document lengths, the maps averaged) it counts the causal (query, key) pairs that dense
attention computes and the most that MSA's selection can attend. A query at document position
``p`` sees ``p + 1`` keys; MSA attends at most ``top_k`` blocks, its own block's ``p % bs + 1``
keys and ``top_k - 1`` earlier full ones, so ``min(p + 1, (top_k - 1) * bs + p % bs + 1)``.

Each pair costs ``14 * heads * head_dim`` FLOPs forward + backward: two matmuls forward (S and
P V), five backward (S again, dP, dV, dQ, dK), two FLOPs per multiply-add. At ``--tflops`` (the
default, 989, is the H100 / H200 SXM dense bf16 peak) that is a floor on the sparse attention's
time that no kernel goes under. The selection, indexer and loss come on top.

Usage::

    python benchmarks/attention_work.py [--tokens 8192,32768,32768:4096,131072:16384,131072]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# layer_bench imports Megatron, whose import-time warnings say nothing about this script.
warnings.filterwarnings("ignore", category=UserWarning)

import torch  # noqa: E402
from layer_bench.model import M3  # noqa: E402
from layer_bench.rows import parse_rows  # noqa: E402
from layer_bench.steps import packed_lengths  # noqa: E402

#: Matmul FLOPs per attended (query, key) pair and per (head, channel), forward + backward.
FLOPS_PER_PAIR_CHANNEL = 14


def document_pairs(length: int, block: int, top_k: int) -> tuple[int, int]:
    """``(dense, sparse)`` causal (query, key) pairs of one document of ``length`` tokens:
    every visible key, and at most ``top_k`` blocks of ``block`` keys (the own block partial)."""
    p = torch.arange(length, dtype=torch.int64)
    dense = length * (length + 1) // 2
    sparse = int(torch.minimum(p + 1, (top_k - 1) * block + p % block + 1).sum())
    return dense, sparse


def row_work(tokens: int, doc_mean: int, *, doc_min: int = 256, seed: int = 0,
             doc_maps: int = 4, block: int = M3.block, top_k: int = M3.topk) -> dict:
    """The mean pairs of the row's ``doc_maps`` seeded document maps (one map for one document),
    drawn as ``bench_layer.py`` draws them."""
    generator = torch.Generator().manual_seed(seed)
    maps = [packed_lengths(tokens, doc_mean, doc_min, generator)
            for _ in range(doc_maps if doc_mean else 1)]
    dense = sparse = documents = 0
    for sizes in maps:
        documents += len(sizes)
        for n in sizes:
            d, s = document_pairs(n, block, top_k)
            dense += d
            sparse += s
    count = len(maps)
    return {"tokens": tokens, "doc_mean": doc_mean, "documents": documents / count,
            "dense_pairs": dense / count, "sparse_pairs": sparse / count}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192,32768,32768:4096,131072:16384,131072")
    ap.add_argument("--doc-min", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--doc-maps", type=int, default=4)
    ap.add_argument("--tflops", type=float, default=989.0,
                    help="the GPU's dense bf16 matmul peak, TFLOP/s")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    if args.tflops <= 0:
        raise SystemExit(f"--tflops={args.tflops}: expected > 0")
    per_pair = FLOPS_PER_PAIR_CHANNEL * M3.heads * M3.head_dim
    rows = []
    print(f"| tokens | doc mean | documents | dense TFLOP | MSA TFLOP at most | dense / MSA "
          f"| MSA ms at {args.tflops:g} TF/s |")
    print("|---|---|---|---|---|---|---|")
    for tokens, mean in parse_rows(args.tokens, [0], "--tokens"):
        r = row_work(tokens, mean, doc_min=args.doc_min, seed=args.seed,
                     doc_maps=args.doc_maps)
        r["dense_tflop"] = r["dense_pairs"] * per_pair / 1e12
        r["sparse_tflop"] = r["sparse_pairs"] * per_pair / 1e12
        r["sparse_floor_ms"] = r["sparse_tflop"] / args.tflops * 1e3
        r["tflops"] = args.tflops
        rows.append(r)
        print(f"| {tokens} | {mean or '-'} | {r['documents']:.1f} | {r['dense_tflop']:.2f} | "
              f"{r['sparse_tflop']:.2f} | {r['dense_pairs'] / r['sparse_pairs']:.2f}x | "
              f"{r['sparse_floor_ms']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
