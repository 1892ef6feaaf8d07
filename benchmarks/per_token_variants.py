#!/usr/bin/env python
"""Where the per-token kernels stand against the GPU's gather bandwidth, and two key-split
variants of them (ADR 0035; GPU only).

The per-token kernels (``_fwd_kernel`` and ``_dq_kernel`` outside a union tile) do most of
the work on a freshly initialized indexer's selections. Each program reads 16 blocks of K and
V (64 KiB per block) for one (token, KV head); at 131072 tokens that is about 550 GB per
forward. This script times, on one document of ``--tokens`` tokens with the real selection of
random index queries (M3 shape):

- ``prod``: the production per-token forward and dq (union kernels off: ``union_qt=0``,
  ``dq_union_qt=0``), each kernel's GPU time from torch.profiler;
- ``gather``: a kernel that only reads the same blocks in the same grid (each K and V element
  once per (token, KV head, slot), xor-folded so that nothing is elided): the bandwidth a
  program of this access pattern gets, with no MMA or softmax;
- ``split``: the same forward and dq with the block's keys split across the warps (each warp
  its own 128 / WS keys of every block, its own running softmax or dq partial, the warps
  combined once per token) instead of across the head dimension, which removes the
  per-block exchange of P / dS through shared memory and the cross-warp row reductions.

Outputs of the split kernels are checked against the production kernels' (relative norm
error; the same function, another summation order).

Usage::

    python benchmarks/per_token_variants.py --tokens 32768,131072 [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from layer_bench.report import commit_id  # noqa: E402
from msa_bench.cases import BS, HKV, HQ, INIT, LOCAL, TOPK, D, fresh_inputs, make_case  # noqa: E402
from msa_bench.timing import log, time_fn, warm_up_gpu  # noqa: E402

from nemo_msa.attention.triton_bwd import triton_attention_backward  # noqa: E402
from nemo_msa.attention.triton_fwd import triton_attention_forward  # noqa: E402
from nemo_msa.selection.triton_select import triton_select_blocks  # noqa: E402
from nemo_msa.testing.oracle import rel_err  # noqa: E402
from nemo_msa.triton.launch import BackwardLaunch, ForwardLaunch  # noqa: E402
from nemo_msa.triton.tiles import LN2_C, LOG2E, LOG2E_C  # noqa: E402


@triton.jit
def _gather_kernel(k_ptr, v_ptr, q2k_ptr, out_ptr, stride_kt, stride_kh, stride_sg, stride_st,
                   TOPK: tl.constexpr, BS: tl.constexpr, D: tl.constexpr):
    """Reads K and V of the TOPK selected blocks of (token, KV head) and xor-folds them."""
    t = tl.program_id(0)
    g = tl.program_id(1)
    t64 = t.to(tl.int64)
    kn = tl.arange(0, BS)
    dd = tl.arange(0, D)
    acc = tl.zeros((BS, D), tl.int16)
    for s in range(TOPK):
        b = tl.load(q2k_ptr + g * stride_sg + t64 * stride_st + s)
        rows = (tl.maximum(b, 0) * BS + kn).to(tl.int64)
        k = tl.load(k_ptr + rows[:, None] * stride_kt + g * stride_kh + dd[None, :])
        v = tl.load(v_ptr + rows[:, None] * stride_kt + g * stride_kh + dd[None, :])
        acc = acc ^ k.to(tl.int16, bitcast=True) ^ v.to(tl.int16, bitcast=True)
    tl.store(out_ptr + t64 * tl.num_programs(1) + g, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


@triton.jit
def _split_program(t0, stride_qt, stride_qh, G: tl.constexpr, BS: tl.constexpr,
                   D: tl.constexpr, WS: tl.constexpr):
    """The program's token ``t0 + pid0`` (int32 and int64), KV head ``pid1``, its G query heads,
    the offsets of their [G, D] rows in a [T, Hq, D] tensor, and the key groups' offsets in a
    block ([WS, BS / WS]: group w holds keys w * BS / WS onwards)."""
    t = t0 + tl.program_id(0)
    g = tl.program_id(1)
    t64 = t.to(tl.int64)
    KS: tl.constexpr = BS // WS
    heads = g * G + tl.arange(0, G)
    rows_q = t64 * stride_qt + heads[:, None] * stride_qh + tl.arange(0, D)[None, :]
    koff = tl.arange(0, WS)[:, None] * KS + tl.arange(0, KS)[None, :]
    return t, g, t64, heads, rows_q, koff


@triton.jit
def _group_rows(ptr, rows_q, WS: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                FP32_DOT: tl.constexpr):
    """The [G, D] rows at ``rows_q`` as every key group's MMA operand, [WS, G, D]."""
    x = tl.load(ptr + rows_q)
    if FP32_DOT:
        x = x.to(tl.float32)
    return tl.broadcast_to(x[None, :, :], (WS, G, D))


@triton.jit
def _split_block(k_ptr, v_ptr, b, koff, t, g, stride_kt, stride_kh, BS: tl.constexpr,
                 D: tl.constexpr, FP32_DOT: tl.constexpr):
    """Block ``b`` of KV head ``g`` for token ``t`` as the key groups ``koff`` ([WS, KS] key
    offsets in the block): the visible-key mask [WS, KS] and K, V [WS, KS, D], zero where not
    visible (no block for b < 0)."""
    j = b * BS + koff
    kmask = (j <= t) & (b >= 0)
    rows = j.to(tl.int64)
    dd = tl.arange(0, D)
    k = tl.load(k_ptr + rows[:, :, None] * stride_kt + g * stride_kh + dd[None, None, :],
                mask=kmask[:, :, None], other=0.0)
    v = tl.load(v_ptr + rows[:, :, None] * stride_kt + g * stride_kh + dd[None, None, :],
                mask=kmask[:, :, None], other=0.0)
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return kmask, k, v


@triton.jit
def _fwd_split_kernel(q_ptr, k_ptr, v_ptr, q2k_ptr, out_ptr, lse_ptr, mass_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_sg, stride_st,
                      stride_lh, stride_mg, stride_mt, scale_log2, t0,
                      TOPK: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                      WS: tl.constexpr, KP: tl.constexpr, FP32_DOT: tl.constexpr):
    """Per-token forward with the block's keys split in WS groups: token ``t0 + pid0`` of one
    document at row 0 (FP32_DOT: fp32 operands, for the interpreter)."""
    t, g, t64, heads, rows_q, koff = _split_program(t0, stride_qt, stride_qh, G, BS, D, WS)
    qb = _group_rows(q_ptr, rows_q, WS, G, D, FP32_DOT)
    m_i = tl.full((WS, G), float("-inf"), tl.float32)
    l_i = tl.zeros((WS, G), tl.float32)
    acc = tl.zeros((WS, G, D), tl.float32)
    kk = tl.arange(0, KP)
    mass = tl.zeros((WS, G, KP), tl.float32)
    for s in range(TOPK):
        b = tl.load(q2k_ptr + g * stride_sg + t64 * stride_st + s)
        kmask, k, v = _split_block(k_ptr, v_ptr, b, koff, t, g, stride_kt, stride_kh, BS, D,
                                   FP32_DOT)
        sc = tl.dot(qb, tl.trans(k, (0, 2, 1))) * scale_log2
        sc = tl.where(kmask[:, None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=2))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        pr = tl.exp2(sc - m_use[:, :, None])
        psum = tl.sum(pr, axis=2)
        l_i = l_i * alpha + psum
        acc = acc * alpha[:, :, None] + tl.dot(pr.to(v.dtype), v)
        mass = mass * alpha[:, :, None] + tl.where((kk == s)[None, None, :], psum[:, :, None], 0.0)
        m_i = m_new
    m_all = tl.max(m_i, axis=0)
    m_all_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m_i - m_all_use[None, :])
    l_all = tl.sum(l_i * w, axis=0)
    empty = l_all == 0.0
    denom = tl.where(empty, 1.0, l_all)
    out = tl.sum(acc * w[:, :, None], axis=0) / denom[:, None]
    lse = tl.where(empty, float("-inf"), (m_all + tl.log2(denom)) * LN2_C)
    tl.store(out_ptr + rows_q, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + heads * stride_lh + t, lse)
    head_mass = tl.sum(mass * w[:, :, None], axis=0) / denom[:, None]
    tl.store(mass_ptr + g * stride_mg + t64 * stride_mt + kk, tl.sum(head_mass, axis=0) / G,
             mask=kk < TOPK)


@triton.jit
def _dq_split_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q2k_ptr,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_sg, stride_st,
                     stride_lh, scale, scale_log2, t0,
                     TOPK: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                     WS: tl.constexpr, FP32_DOT: tl.constexpr):
    """Per-token dq with the block's keys split in WS groups: token ``t0 + pid0`` of one
    document at row 0 (FP32_DOT: fp32 operands, for the interpreter)."""
    t, g, t64, heads, rows_q, koff = _split_program(t0, stride_qt, stride_qh, G, BS, D, WS)
    qb = _group_rows(q_ptr, rows_q, WS, G, D, FP32_DOT)
    dob = _group_rows(do_ptr, rows_q, WS, G, D, FP32_DOT)
    lse2 = tl.load(lse_ptr + heads * stride_lh + t) * LOG2E_C
    delta = tl.load(delta_ptr + heads * stride_lh + t)
    dq = tl.zeros((WS, G, D), tl.float32)
    for s in range(TOPK):
        b = tl.load(q2k_ptr + g * stride_sg + t64 * stride_st + s)
        kmask, k, v = _split_block(k_ptr, v_ptr, b, koff, t, g, stride_kt, stride_kh, BS, D,
                                   FP32_DOT)
        sc = tl.dot(qb, tl.trans(k, (0, 2, 1))) * scale_log2
        pr = tl.where(kmask[:, None, :], tl.exp2(sc - lse2[None, :, None]), 0.0)
        dp = tl.dot(dob, tl.trans(v, (0, 2, 1)))
        ds = pr * (dp - delta[None, :, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + rows_q, (tl.sum(dq, axis=0) * scale).to(dq_ptr.dtype.element_ty))


def events_ms(fn, reps: int) -> float:
    """Median CUDA-event ms of ``fn()`` over ``reps`` calls after a warm-up call."""
    return time_fn(lambda _: fn(), [None], min_reps=reps, max_reps=reps, warmup=1)[0]


def kernel_ms(fn, names: tuple[str, ...], reps: int) -> dict:
    """GPU ms per call of the kernels whose names start with each of ``names`` (torch.profiler
    over ``reps`` calls after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        for n in names:
            if ev.key.startswith(n):
                out[n] = out.get(n, 0.0) + ev.self_device_time_total / 1e3 / reps
    return out


def run(tokens: int, reps: int, gen: torch.Generator) -> dict:
    case = make_case(f"doc{tokens}", [[tokens]], tokens, "cuda")
    msa = case["msa"]
    x = fresh_inputs(tokens, "cuda", gen)
    q2k = triton_select_blocks(x["iq"], x["ik"], msa, top_k=TOPK, init_blocks=INIT,
                               local_blocks=LOCAL)
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    scale = 1.0 / math.sqrt(D)
    fwd_cfg, bwd_cfg = ForwardLaunch(union_qt=0), BackwardLaunch(dq_union_qt=0)
    r = {"tokens": tokens, "gpu": torch.cuda.get_device_name(), "commit": commit_id()}

    out, lse, mass = triton_attention_forward(q, k, v, q2k, msa, scale, launch=fwd_cfg,
                                              return_block_mass=True)

    def prod_fwd():
        triton_attention_forward(q, k, v, q2k, msa, scale, launch=fwd_cfg,
                                 return_block_mass=True)

    def prod_bwd():
        triton_attention_backward(do, q, k, v, out, lse, q2k, msa, scale, launch=bwd_cfg)

    r["prod_fwd_ms"] = kernel_ms(prod_fwd, ("_fwd_kernel",), reps).get("_fwd_kernel")
    r["prod_dq_ms"] = kernel_ms(prod_bwd, ("_dq_kernel",), reps).get("_dq_kernel")
    dq_ref = triton_attention_backward(do, q, k, v, out, lse, q2k, msa, scale,
                                       launch=bwd_cfg)[0]

    grid = (tokens, HKV)
    sg, st = q2k.stride(0), q2k.stride(1)
    folded = torch.empty((tokens, HKV), dtype=torch.int16, device="cuda")
    for warps in (4, 8):
        def gather(warps=warps):
            _gather_kernel[grid](k, v, q2k, folded, k.stride(0), k.stride(1), sg, st,
                                 TOPK=TOPK, BS=BS, D=D, num_warps=warps)
        ms = events_ms(gather, reps)
        r[f"gather_w{warps}_ms"] = ms
        r[f"gather_w{warps}_tbs"] = tokens * HKV * TOPK * 2 * BS * D * 2 / ms / 1e9

    delta = (do.float() * out.float()).sum(-1).t().contiguous()
    for warps, ws, stages, maxnreg in ((8, 8, 2, None), (4, 4, 2, None), (8, 8, 3, None),
                                       (8, 8, 2, 128)):
        tag = f"w{warps}_ws{ws}_s{stages}" + (f"_r{maxnreg}" if maxnreg else "")
        cap = {"maxnreg": maxnreg} if maxnreg else {}
        o2, l2, m2 = torch.empty_like(q), torch.empty_like(lse), torch.empty_like(mass)

        def fwd(warps=warps, ws=ws, stages=stages, cap=cap, o2=o2, l2=l2, m2=m2):
            _fwd_split_kernel[grid](q, k, v, q2k, o2, l2, m2, q.stride(0), q.stride(1),
                                    k.stride(0), k.stride(1), sg, st, l2.stride(0),
                                    m2.stride(0), m2.stride(1), scale * LOG2E, 0, TOPK=TOPK,
                                    G=HQ // HKV, BS=BS, D=D, WS=ws, KP=TOPK, FP32_DOT=False,
                                    num_warps=warps, num_stages=stages, **cap)
        try:
            r[f"split_fwd_{tag}_ms"] = events_ms(fwd, reps)
            r[f"split_fwd_{tag}_err"] = [rel_err(o2, out), rel_err(l2, lse), rel_err(m2, mass)]
        except Exception as exc:  # a variant that does not compile or launch is a result too
            r[f"split_fwd_{tag}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        dq2 = torch.empty_like(q)

        def dq(warps=warps, ws=ws, stages=stages, cap=cap, dq2=dq2):
            _dq_split_kernel[grid](q, k, v, do, lse, delta, dq2, q2k, q.stride(0), q.stride(1),
                                   k.stride(0), k.stride(1), sg, st, lse.stride(0), scale,
                                   scale * LOG2E, 0, TOPK=TOPK, G=HQ // HKV, BS=BS, D=D, WS=ws,
                                   FP32_DOT=False, num_warps=warps, num_stages=stages, **cap)
        try:
            r[f"split_dq_{tag}_ms"] = events_ms(dq, reps)
            r[f"split_dq_{tag}_err"] = rel_err(dq2, dq_ref)
        except Exception as exc:
            r[f"split_dq_{tag}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    r["block_reads_gb"] = tokens * HKV * TOPK * 2 * BS * D * 2 / 1e9
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="32768,131072")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("per_token_variants.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    warm_up_gpu()
    results = []
    for tokens in (int(x) for x in args.tokens.split(",")):
        r = run(tokens, args.reps, gen)
        log(json.dumps(r))
        results.append(r)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
