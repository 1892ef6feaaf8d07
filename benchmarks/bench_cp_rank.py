#!/usr/bin/env python
"""Times ONE context-parallel rank's share of a MiniMax-M3-shaped MSA layer's training step
(issue 24, item 4): what one GPU of a CP group computes, without the communication.

One GPU cannot run a CP group, but it can run one rank's work: that rank's local queries (the
load-balanced chunks r and 2N-1-r of the sequence, Megatron's split) against the whole
sequence's K, V and index keys, which a real rank receives from the all-gather. Here the other
ranks' rows of K / V / index_k are random inputs and the rank's own rows are written into them
(``index_copy``, differentiable, the stand-in of the gather), so the backward produces
global-sized dK / dV / d index_k as the reduce-scatter would receive them. No bytes travel: the
communication's cost is modelled in the CP ADR, not measured here.

The step DRIVES THE OPS DIRECTLY (the Megatron layer's CP path is not used): RMSNorm, the fused
QKV GEMM, partial RoPE (64 of 128 channels, document positions), the indexer projections with
their norms and RoPE (on the detached input, as the indexer), the rank's rows placed into the
gathered K / V / index_k, Triton block selection with its by-products (``queries`` = the local
rows), the Triton sparse attention forward (with the per-slot block mass) and backward, the
sparse indexer loss from the by-products, the output GEMM and the SwiGLU FFN; forward and
backward of ``mean(y^2) + indexer loss``, bf16. Not included: embedding, LM head, optimizer.
The layout (``MSAMicrobatch``) and the subset's kernel view are built inside the step, once
per microbatch as in training. Shape: hidden 6144, FFN 16384, 64 query / 4 KV heads of 128,
index heads 4 x 128, blocks of 128, top-16 (``--tiny``: the layer bench's tiny shape).

Rows: for each ``--cp TOKENS:CP`` pair, the ranks of ``--ranks`` (``extremes``: the most- and
least-loaded rank by the selection's candidate blocks, sum over local queries of own block + 1;
ties go to the lowest and highest rank; or ``all``, or a comma list), and, beside them, the
single-GPU step (``cp_size`` 1, no subset) at ``--baseline`` tokens. Per row: ``step_ms``
(median of ``--steps`` after ``--warmup``), ``peak_gib`` (max allocated during the row,
parameters and gradients included), ``local_tokens``, ``candidate_blocks``, and per CP pair
``ratio_to_baseline`` and ``max_over_min`` of the measured ranks. The JSON rows have the layer
bench's format plus ``cp_size`` / ``cp_rank``.

Usage (H200)::

    python benchmarks/bench_cp_rank.py --json $OUT/cp_rank.json --time-budget-s 420
    python benchmarks/bench_cp_rank.py --tiny --cp 128:2,256:4 --baseline 64 --json /tmp/cp.json

On a machine without CUDA (or with ``--cpu``) the kernels run under the Triton interpreter, so
only ``--tiny`` sizes are practical.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch

# The kernels are compiled or interpreted when their modules are imported: decide first.
if "--cpu" in sys.argv or not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from layer_bench.report import commit_id, log, write_json  # noqa: E402
from layer_bench.timing import free_memory, run_row  # noqa: E402

from nemo_msa import MSAMicrobatch  # noqa: E402
from nemo_msa.attention.triton_bwd import triton_attention_backward  # noqa: E402
from nemo_msa.attention.triton_fwd import triton_attention_forward  # noqa: E402
from nemo_msa.context_parallel import load_balanced_indices  # noqa: E402
from nemo_msa.indexer_loss import sparse_indexer_loss_from_byproducts  # noqa: E402
from nemo_msa.selection.triton_select import triton_select_blocks  # noqa: E402
from nemo_msa.testing.packs import document_map_from_lengths  # noqa: E402

#: (hidden, ffn, heads, groups, head_dim, index_heads, index_dim, block, topk) as the layer bench
M3 = dict(hidden=6144, ffn=16384, heads=64, groups=4, head_dim=128, index_heads=4,
          index_dim=128, block=128, topk=16)
TINY = dict(hidden=128, ffn=256, heads=4, groups=2, head_dim=32, index_heads=2, index_dim=32,
            block=16, topk=4)
DEFAULT_CP = "262144:2,524288:4,1048576:8"


def candidate_blocks(doc_lengths: list[int], seq_len: int, cp: int, rank: int, block: int) -> int:
    """The rank's selection work: sum over its local queries of (own block + 1)."""
    pos = torch.cat([torch.arange(n) for n in doc_lengths])
    cols = load_balanced_indices(seq_len, cp, rank)
    return int((pos[cols] // block + 1).sum())


def _rms_norm(x, w, eps=1e-6):
    return (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)).to(
        x.dtype) * w


def _rope(x, pos, base=5_000_000.0):
    """Partial RoPE on the first half of the channels (rotary_percent 0.5), rotate-half."""
    rot = x.shape[-1] // 2
    inv = 1.0 / base ** (torch.arange(0, rot, 2, device=x.device, dtype=torch.float32) / rot)
    ang = pos.float()[:, None] * inv[None]  # [T, rot / 2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].to(x.dtype)
    head = x[..., :rot]
    half = torch.cat([-head[..., rot // 2:], head[..., :rot // 2]], -1)
    squeeze = x.dim() == 2
    if squeeze:
        cos, sin = cos[:, 0], sin[:, 0]
    return torch.cat([head * cos + half * sin, x[..., rot:]], -1)


class _SparseAttention(torch.autograd.Function):
    """Triton sparse attention of the local queries over the global K / V (block mass out)."""

    @staticmethod
    def forward(ctx, q, k, v, q2k, msa, queries):
        out, lse, unions, mass = triton_attention_forward(
            q, k, v, q2k, msa, return_unions=True, return_block_mass=True, queries=queries)
        ctx.save_for_backward(q, k, v, out, lse, q2k)
        ctx.extra = (msa, unions, queries)
        ctx.mark_non_differentiable(mass)
        return out, mass

    @staticmethod
    def backward(ctx, dout, _dmass):
        q, k, v, out, lse, q2k = ctx.saved_tensors
        msa, unions, queries = ctx.extra
        dq, dk, dv = triton_attention_backward(dout.contiguous(), q, k, v, out, lse, q2k, msa,
                                               unions=unions, queries=queries)
        return dq, dk, dv, None, None, None


def make_params(s: dict, device, dtype) -> dict:
    """The layer's weights (random, scaled so activations stay O(1)), with gradients."""
    g = torch.Generator(device=device).manual_seed(0)
    h, d = s["hidden"], s["head_dim"]

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=device) / math.sqrt(shape[0])).to(
            dtype).requires_grad_(True)

    return {
        "ln1": torch.ones(h, device=device, dtype=dtype, requires_grad=True),
        "ln2": torch.ones(h, device=device, dtype=dtype, requires_grad=True),
        "qkv": w(h, (s["heads"] + 2 * s["groups"]) * d),
        "o": w(s["heads"] * d, h),
        "iq": w(h, s["index_heads"] * s["index_dim"]),
        "ik": w(h, s["index_dim"]),
        "iq_norm": torch.ones(s["index_dim"], device=device, dtype=dtype, requires_grad=True),
        "ik_norm": torch.ones(s["index_dim"], device=device, dtype=dtype, requires_grad=True),
        "fc1": w(h, 2 * s["ffn"]),
        "fc2": w(s["ffn"], h),
    }


def rank_step(s: dict, p: dict, seq_len: int, doc_lengths: list[int], cp: int, rank: int,
              device, dtype):
    """``(prepare, run)`` of one rank's step (``cp`` 1: the single-GPU step, no subset)."""
    tq = seq_len // cp
    hq, g, d = s["heads"], s["groups"], s["head_dim"]

    def prepare():
        ids = document_map_from_lengths([doc_lengths], seq_len, device)
        # One row with no padding: compact rows are the columns.
        queries = None if cp == 1 else load_balanced_indices(seq_len, cp, rank, device)
        x = torch.randn(tq, s["hidden"], device=device, dtype=dtype, requires_grad=True)
        rest = None
        if cp > 1:  # the other ranks' rows of the gathered tensors
            rest = (torch.randn(seq_len, g, d, device=device, dtype=dtype),
                    torch.randn(seq_len, g, d, device=device, dtype=dtype),
                    torch.randn(seq_len, s["index_dim"], device=device, dtype=dtype))
        return ids, queries, x, rest

    def run(inputs):
        ids, queries, x, rest = inputs
        msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=s["block"], init_blocks=0,
                                  local_blocks=1)
        pos = msa.document_positions if queries is None else msa.document_positions[queries]
        h = _rms_norm(x, p["ln1"])
        q, k, v = (h @ p["qkv"]).view(tq, hq + 2 * g, d).split([hq, g, g], dim=1)
        q, k = _rope(q, pos), _rope(k, pos)
        hd = h.detach()
        iq = _rope(_rms_norm((hd @ p["iq"]).view(tq, s["index_heads"], s["index_dim"]),
                             p["iq_norm"]), pos)
        ik = _rope(_rms_norm(hd @ p["ik"], p["ik_norm"]), pos)
        if rest is not None:  # the all-gather's result, the local rows in place
            k = rest[0].index_copy(0, queries, k)
            v = rest[1].index_copy(0, queries, v.contiguous())
            ik = rest[2].index_copy(0, queries, ik)
        q2k = triton_select_blocks(
            iq.detach().contiguous(), ik.detach().contiguous(), msa, top_k=s["topk"],
            init_blocks=0, local_blocks=1, queries=queries)
        out, mass = _SparseAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), q2k,
                                           msa, queries)
        idx_loss, _ = sparse_indexer_loss_from_byproducts(
            iq, ik, q2k, mass, msa, num_index_heads_total=s["index_heads"], loss_coeff=1.0,
            queries=queries)
        x2 = x + out.reshape(tq, hq * d) @ p["o"]
        a, b = (_rms_norm(x2, p["ln2"]) @ p["fc1"]).chunk(2, dim=-1)
        y = x2 + (torch.nn.functional.silu(a) * b) @ p["fc2"]
        (y.float().square().mean() + idx_loss).backward()

    return prepare, run


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"262144:2,524288:4"`` -> [(262144, 2), (524288, 4)]."""
    pairs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            tokens, cp = (int(v) for v in item.split(":"))
        except ValueError:
            raise SystemExit(f"--cp={text!r}: expected TOKENS:CP pairs, got {item!r}") from None
        if cp < 2 or tokens <= 0 or tokens % (2 * cp):
            raise SystemExit(f"--cp {item}: expected CP >= 2 and TOKENS a multiple of 2 * CP")
        pairs.append((tokens, cp))
    if not pairs:
        raise SystemExit(f"--cp={text!r}: expected at least one TOKENS:CP pair")
    return pairs


def pick_ranks(spec: str, loads: list[int]) -> list[int]:
    """The ranks to time: ``extremes`` (most- and least-loaded), ``all`` or a comma list."""
    cp = len(loads)
    if spec == "all":
        return list(range(cp))
    if spec == "extremes":
        hi = max(range(cp), key=lambda r: (loads[r], -r))
        lo = min(range(cp), key=lambda r: (loads[r], -r))
        if loads[hi] == loads[lo]:
            hi, lo = 0, cp - 1
        return sorted({hi, lo})
    try:
        ranks = [int(r) for r in spec.split(",")]
    except ValueError:
        raise SystemExit(f"--ranks={spec!r}: expected extremes, all or a comma list") from None
    return [r for r in ranks if 0 <= r < cp]


def main(argv: list[str] | None = None) -> int:
    """Parses the arguments, times every row and writes the JSON (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", default=None, help=f"TOKENS:CP pairs (default {DEFAULT_CP})")
    ap.add_argument("--ranks", default="extremes", help="extremes, all, or a comma list")
    ap.add_argument("--baseline", type=int, default=None,
                    help="single-GPU step tokens (default 131072; --tiny 64; 0: none)")
    ap.add_argument("--doc-tokens", type=int, default=0,
                    help="documents of this many tokens per sequence (0: one document)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-step-s", type=float, default=60.0)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no row after this many seconds (the rest are skipped)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-top", type=int, default=12)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    s = TINY if args.tiny else M3
    pairs = parse_pairs(args.cp or ("128:2,256:4" if args.tiny else DEFAULT_CP))
    baseline = args.baseline if args.baseline is not None else (64 if args.tiny else 131072)
    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu and not args.tiny:
        raise SystemExit("the MiniMax-M3 shape needs a CUDA GPU; on the CPU run with --tiny")
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit(f"--steps={args.steps} --warmup={args.warmup}: expected both >= 1")
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    started = time.monotonic()
    rows: list[dict] = []
    result = {
        "gpu": torch.cuda.get_device_name(0) if on_gpu else "cpu", "commit": commit_id(),
        "torch": torch.__version__,
        "command": " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
        "shape": s, "dtype": str(dtype),
        "step": "one CP rank's MSA layer forward+backward (ops driven directly; gathered "
                "K/V/index_k are inputs, no communication; sparse indexer loss from the "
                "kernels' by-products; no embedding / LM head / optimizer)",
        "rows": rows,
    }

    def docs(tokens: int) -> list[int]:
        n = args.doc_tokens if 0 < args.doc_tokens < tokens else tokens
        return [n] * (tokens // n) + ([tokens % n] if tokens % n else [])

    plan = [(baseline, 1, 0)] if baseline else []
    for tokens, cp in pairs:
        loads = [candidate_blocks(docs(tokens), tokens, cp, r, s["block"]) for r in range(cp)]
        plan += [(tokens, cp, r, loads[r]) for r in pick_ranks(args.ranks, loads)]
    params = make_params(s, device, dtype)
    for entry in plan:
        tokens, cp, rank = entry[:3]
        row = {"tokens": tokens, "case": "msa_sparse_loss_cp_rank", "cp_size": cp,
               "cp_rank": rank, "local_tokens": tokens // cp, "step_ms": None,
               "peak_gib": None}
        if len(entry) > 3:
            row["candidate_blocks"] = entry[3]
        if args.time_budget_s is not None and time.monotonic() - started > args.time_budget_s:
            row.update(status="skipped", note="--time-budget-s spent")
        else:
            run_row(rank_step(s, params, tokens, docs(tokens), cp, rank, device, dtype), args,
                    on_gpu, row, "step_ms")
            for w in params.values():
                w.grad = None
            free_memory(on_gpu)
        if row.get("status") == "ok":
            row["tokens_per_s"] = row["local_tokens"] / (row["step_ms"] / 1e3)
        rows.append(row)
        log(json.dumps(row))
        _summarize(result)
        if args.json:
            write_json(args.json, result)
    log("\n" + "\n".join(f"{r['tokens']:>8} cp={r['cp_size']} rank={r['cp_rank']} "
                         f"{r['status']:<8} step_ms={r['step_ms']} peak_gib={r['peak_gib']}"
                         for r in rows))
    log(json.dumps(result.get("summary", {})))
    return 0 if all(r["status"] in ("ok", "oom", "too_slow", "skipped") for r in rows) else 1


def _summarize(result: dict) -> None:
    """Per CP pair: each measured rank's step over the baseline's, and max / min over ranks."""
    rows = [r for r in result["rows"] if r.get("status") == "ok"]
    base = next((r["step_ms"] for r in rows if r["cp_size"] == 1), None)
    summary = {}
    for r in rows:
        if r["cp_size"] == 1:
            continue
        key = f"{r['tokens']}:{r['cp_size']}"
        entry = summary.setdefault(key, {"step_ms": {}})
        entry["step_ms"][r["cp_rank"]] = r["step_ms"]
        times = list(entry["step_ms"].values())
        entry["max_over_min"] = max(times) / min(times)
        if base:
            entry["ratio_to_baseline"] = max(times) / base
    result["summary"] = summary


if __name__ == "__main__":
    sys.exit(main())
