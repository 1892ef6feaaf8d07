"""Times torch SDPA backends on one causal GQA document, with the plan cached and with a new
length each call (what packed batches of fresh document lengths cost), to choose the dense
path's backend per document length (docs/adr/0012-dense-document-attention.md).

Rows: per length and backend, forward+backward ms (median after warm-up, fresh random bf16
inputs per call): ``cached`` repeats one length; ``fresh`` adds 1..reps tokens so every call is a
shape cuDNN has not planned (flash has no plans). Writes JSON with ``--json``.

Usage::

    python scripts/bench_dense_sdpa.py [--lengths 1024,4096,16384] [--heads 64/4] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_one(backend, length, hq, hkv, d, reps, fresh, warmup=2):
    """Median fwd+bwd ms of one [1, H, length(+i), d] causal GQA SDPA call."""
    times = []
    for i in range(warmup + reps):
        n = length + (i + 1 if fresh else 0)
        q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with sdpa_kernel([BACKENDS[backend]]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(dout)
        stop.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--heads", default="64/4", help="query/KV heads")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    rows = []
    print("| length | backend | cached ms | fresh-length ms |")
    print("|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        for backend in BACKENDS:
            row = {"length": length, "backend": backend}
            for mode in ("cached", "fresh"):
                try:
                    row[mode] = time_one(backend, length, hq, hkv, args.dim, args.reps,
                                         mode == "fresh")
                except RuntimeError as error:  # a backend that refuses the shape
                    row[mode] = None
                    row["error"] = str(error).splitlines()[0][:120]
                    torch.cuda.empty_cache()
            rows.append(row)
            fmt = lambda x: "-" if x is None else f"{x:.2f}"
            print(f"| {length} | {backend} | {fmt(row['cached'])} | {fmt(row['fresh'])} |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "heads": args.heads, "dim": args.dim, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
