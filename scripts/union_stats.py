#!/usr/bin/env python
"""How the Triton kernels' hybrid schedule splits a selection, measured on the CPU (ADR 0031).

For one row of ``--tokens`` tokens (one document, or packed documents of mean ``--doc-mean`` as
``scripts/bench_layer.py`` packs them), M3-shaped index inputs (4 heads x 128, blocks of 128,
top-16, the own block forced) go through the reference selection; random index vectors (as a
freshly initialized indexer's) or ``--coherent`` ones (shared per 128-token block + 5% noise, as
``bench_msa.py --coherent``). For each union tile size ``--qt`` and cap ``--caps`` it prints the
mean union, the share of tiles and of the exact work the union kernel takes, and how much more
work it does there than the exact selection (every row of a tile pays for every union block).

Usage::

    python scripts/union_stats.py --tokens 8192 [--doc-mean 4096] [--coherent] \
        [--qt 8,4,2] [--caps 16,24,30,40,64]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# layer_bench imports Megatron, whose import-time warnings say nothing about this script.
warnings.filterwarnings("ignore", category=UserWarning)

import torch  # noqa: E402
from layer_bench.steps import packed_lengths  # noqa: E402
from msa_bench.cases import BS, DI, HI, INIT, LOCAL, TOPK, coherent_index_q, make_case  # noqa: E402
from msa_bench.unions import hybrid_work, tile_union_sizes  # noqa: E402

from nemo_msa.selection.naive import select_blocks_reference  # noqa: E402


def int_list(text: str, name: str) -> list[int]:
    """``"8,4,2"`` -> ``[8, 4, 2]`` (each >= 1)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name}={text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{name}={text!r}: expected integers >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    """Prints the table (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the row")
    ap.add_argument("--doc-mean", type=int, default=0,
                    help="packed documents of this mean length (0: one document)")
    ap.add_argument("--doc-min", type=int, default=256, help="shortest packed document")
    ap.add_argument("--coherent", action="store_true", help="trained-like index queries")
    ap.add_argument("--qt", default="8,4,2", help="union tile sizes (tokens)")
    ap.add_argument("--caps", default="16,24,30,40,64", help="union_max values (blocks)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    qts, caps = int_list(args.qt, "--qt"), int_list(args.caps, "--caps")
    if args.tokens < 1 or args.tokens % BS:
        raise SystemExit(f"--tokens={args.tokens}: expected a positive multiple of {BS}")
    gen = torch.Generator().manual_seed(args.seed)
    lengths = packed_lengths(args.tokens, args.doc_mean, args.doc_min, gen)
    msa = make_case("row", [lengths], args.tokens, "cpu")["msa"]
    index_k = torch.randn((args.tokens, DI), generator=gen)
    index_q = (coherent_index_q(args.tokens, "cpu", gen).float() if args.coherent
               else torch.randn((args.tokens, HI, DI), generator=gen))
    q2k = select_blocks_reference(index_q, index_k, msa, top_k=TOPK, init_blocks=INIT,
                                  local_blocks=LOCAL)
    print(f"{args.tokens} tokens, {len(lengths)} documents (mean {args.tokens / len(lengths):.0f}),"
          f" {'coherent' if args.coherent else 'random'} index queries, top-{TOPK} of {BS}-token "
          "blocks")
    print("| qt | mean union | cap | union tiles | exact work on the union kernel "
          "| union work / exact there |")
    print("|---|---|---|---|---|---|")
    for qt in qts:
        union, tokens, exact = tile_union_sizes(q2k, msa.token_documents,
                                                msa.document_positions, qt)
        mean = union.float().mean().item()
        for cap in caps:
            w = hybrid_work(union, tokens, exact, cap)
            print(f"| {qt} | {mean:.1f} | {cap} | {w['union_tiles']:.0%} "
                  f"| {w['union_exact_share']:.0%} | {w['union_inflation']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
