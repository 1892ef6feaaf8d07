#!/usr/bin/env python
"""Counts, on the CPU, the kernels one training step of a small MiniMax-M3-shaped layer launches.

The GPU step of an MSA layer is longer than the dense layer's partly by its count of small
kernels (issue #28: 652 against 357 at 8192 tokens on the H200, each a launch the host pays and
the GPU may idle for). This tool runs one forward + backward of ``benchmarks/bench_layer.py``'s
model at a small M3-like shape (8 query heads per KV head, index heads of the KV heads, 16
candidate blocks per document and top-4, so a quarter of a document's queries select every
candidate block, as at 8192 tokens with M3's top-16 of 128) under :class:`nemo_msa.testing.op_count.
OpCounter`, for each case, and prints per case the kernel-launching aten ops and Triton launches
by where they come from (the package function, or the backward node of a built-in op), then the
difference MSA minus dense per site.

The Triton backend runs under the interpreter (set ``TRITON_INTERPRET=1``; bf16) so its kernel
launches are counted as the GPU would launch them (its plan runs the fused helpers: the norms,
RoPE, loss passes and the sampled recall take their Triton kernels, as on CUDA);
``--backend reference`` counts the torch reference path instead (fp32). What the
CPU count cannot show: torch ops that are one fused kernel on CUDA but decompose on the CPU
(``rms_norm``: pow, mean, add, rsqrt, mul each way).

Usage::

    TRITON_INTERPRET=1 python benchmarks/count_layer_ops.py [--tokens 256] [--doc-mean 0]
    python benchmarks/count_layer_ops.py --backend reference --json counts.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from layer_bench.model import Shape, build_model, case_config, init_single_rank  # noqa: E402
from layer_bench.steps import layer_step  # noqa: E402

from nemo_msa.backends import registry as backends  # noqa: E402
from nemo_msa.testing.op_count import OpCounter  # noqa: E402

#: M3's proportions, small: 8 query heads per KV head, index heads = KV heads.
SMALL_M3 = Shape(hidden=256, ffn=256, heads=16, groups=2, head_dim=32, index_heads=2,
                 index_dim=32, block=16, topk=4, vocab=256)


def count_step(case: str, tokens: int, backend: str, doc_mean: int = 0,
               layers: int = 1) -> OpCounter:
    """One warm-up step, then one counted step of ``case`` (see ``layer_bench.model.CASES``).

    Args:
        case: the bench case (``dense``, ``msa_sparse_loss``, ...).
        tokens: the row length (a multiple of 16).
        backend: ``triton`` (needs ``TRITON_INTERPRET=1``) or ``reference``.
        doc_mean: packed documents of this mean length (0: one document).
        layers: transformer layers of the case's kind (what each layer after the first adds is
            the per-layer cost; the first also pays the microbatch's layout).

    Returns:
        The counter of the counted step.
    """
    triton = backend == "triton"
    if triton and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--backend triton counts under the interpreter: set TRITON_INTERPRET=1")
    config = case_config(case, SMALL_M3, on_gpu=False, layers=layers)
    config.msa_backend = backend
    if triton:
        config.params_dtype = torch.bfloat16
        config.bf16 = True
        # The Triton record refuses the CPU; the interpreter runs its kernels there.
        record = backends.get_backend("triton")
        backends._REGISTRY["triton"] = dataclasses.replace(
            record, unavailable_reason=lambda device: None
        )
    model = build_model(config, SMALL_M3, tokens, on_gpu=False)
    if triton:
        model = model.to(torch.bfloat16)
    prepare, run = layer_step(model, SMALL_M3, tokens, torch.device("cpu"), doc_mean=doc_mean,
                              doc_min=16, doc_maps=1)
    run(prepare())
    x = prepare()
    with OpCounter() as ops:
        run(x)
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--doc-mean", type=int, default=0)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--backend", choices=("triton", "reference"), default="triton")
    ap.add_argument("--cases", default="dense,msa_sparse_loss")
    ap.add_argument("--top", type=int, default=None, help="lines per case (default all)")
    ap.add_argument("--json", default=None, help="write {case: {total, sites, syncs}} here")
    args = ap.parse_args()
    init_single_rank(on_gpu=False)
    torch.manual_seed(0)
    counts = {}
    for case in args.cases.split(","):
        counts[case] = count_step(case, args.tokens, args.backend, args.doc_mean, args.layers)
        print(f"== {case}: {counts[case].total} kernel-launching ops")
        print(counts[case].table(args.top))
    if args.json:
        Path(args.json).write_text(json.dumps({
            case: {"total": ops.total, "sites": dict(ops.by_site()), "syncs": dict(ops.syncs)}
            for case, ops in counts.items()
        }, indent=1))
    if "dense" in counts:
        for case, ops in counts.items():
            if case == "dense":
                continue
            diff = collections.Counter(ops.by_site())
            diff.subtract(counts["dense"].by_site())
            print(f"== {case} - dense: {ops.total - counts['dense'].total} ops, by site")
            for site, n in sorted(diff.items(), key=lambda kv: -abs(kv[1])):
                if n:
                    print(f"{n:+5d}  {site}")


if __name__ == "__main__":
    main()
