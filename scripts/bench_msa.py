"""Checks and times the Triton MSA kernels against the reference and dense cuDNN SDPA.

For each case (single documents of 8192..131072 tokens, a packed batch of mixed documents):

1. correctness, fresh random inputs:
   * selection: exact-match fraction of rows vs a float64 brute-force oracle on a random subset
     of query tokens (all sizes), and vs the package reference (``select_blocks_reference``)
     on all rows where it is affordable (``--full-check-max`` tokens);
   * forward out/lse and dq: relative norm error vs float64 on a query subset (rows of
     different tokens are independent, so the subset is exact);
   * full out/dq/dk/dv vs the package reference run in float64 where affordable;
   * the backward in deterministic mode (atomic-free) twice: bitwise equal?
2. timing with CUDA events (median of many runs after warm-up, inputs rotated among several
   fresh random sets): selection, sparse forward, sparse backward, MSA forward
   (selection + forward), MSA forward+backward, the backward again in deterministic mode
   ("bwd det"), dense cuDNN SDPA (causal, enable_gqa)
   forward and forward+backward on the same shapes;
3. one table, printed last: times, speedups, effective TFLOP/s (selected-block FLOPs), peak
   extra memory.

Usage (on the GPU)::

    python scripts/bench_msa.py [--sizes 8192,32768,65536,131072] [--packed 32768] [--sweep]

It needs a CUDA GPU; the CPU checks of the same kernels are tests/msa_kernels (interpreter).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch

HQ, HKV, D, HI, DI = 64, 4, 128, 4, 128
BS, TOPK, INIT, LOCAL = 128, 16, 0, 1


def _log(*a):
    print(*a, flush=True)


def make_case(name, rows, seq_len, device, block_size=BS):
    from nemo_msa.layout import MSAMicrobatch

    ids = torch.zeros((len(rows), seq_len), dtype=torch.int64)
    for r, docs in enumerate(rows):
        off = 0
        for i, n in enumerate(docs):
            ids[r, off:off + n] = i + 1
            off += n
    ids = ids.to(device)
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=block_size, init_blocks=INIT,
                              local_blocks=LOCAL)
    return {"name": name, "rows": rows, "seq_len": seq_len, "msa": msa, "ids": ids}


def packed_rows(total, lo, hi, per_row, gen):
    """Rows of ``per_row`` slots filled with documents of lo..hi tokens; some padding left."""
    rows, left = [], total
    while left > 0:
        docs, room = [], min(per_row, left)
        while room >= lo:
            n = int(torch.randint(lo, min(hi, room) + 1, (1,), generator=gen))
            docs.append(n)
            room -= n
        rows.append(docs)
        left -= per_row
    return rows


COHERENT = False  # set by --coherent


def fresh_inputs(t, device, gen, hq=HQ, hkv=HKV, d=D, hi=HI, di=DI):
    def rnd(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(
            torch.bfloat16)

    if COHERENT:
        # What a trained indexer gives: neighbouring queries pick mostly the same blocks.
        # One random index query per 128-token block of the compact order, plus 5% noise.
        base = torch.randn((t // BS + 1, hi, di), generator=gen, device=device)
        iq = (base[torch.arange(t, device=device) // BS]
              + 0.05 * torch.randn((t, hi, di), generator=gen, device=device)).to(torch.bfloat16)
    else:
        iq = rnd(t, hi, di)
    return {"iq": iq, "ik": rnd(t, di), "q": rnd(t, hq, d), "k": rnd(t, hkv, d),
            "v": rnd(t, hkv, d), "do": rnd(t, hq, d)}


# ----------------------------------------------------------------------------- oracles


def oracle_select_rows(iq, ik, msa, rows, top_k=TOPK, bs=BS):
    """float64 canonical selection for the query tokens ``rows`` (int64 [S]) -> [H, S, top_k]."""
    cu = msa.cu_seqlens.long()
    doc = msa.token_documents.long()[rows]
    pos = msa.document_positions.long()[rows]
    h = iq.shape[1]
    out = torch.full((h, rows.numel(), top_k), -1, dtype=torch.int32, device=iq.device)
    for i in range(rows.numel()):  # S is small; one float64 product per row
        s, p = int(cu[doc[i]]), int(pos[i])
        o = p // bs
        keys = ik[s:s + p + 1].double()
        sc = iq[rows[i]].double() @ keys.t()  # [H, p+1]
        nblk = o + 1
        padded = torch.full((h, nblk * bs), float("-inf"), dtype=torch.float64,
                            device=iq.device)
        padded[:, : p + 1] = sc
        bsc = padded.view(h, nblk, bs).amax(-1)
        ids = torch.arange(nblk, device=iq.device)
        forced = (ids < INIT) | (ids > o - LOCAL)
        val = torch.where(torch.isnan(bsc), -1e308, bsc)
        val = torch.where(forced[None], float("inf"), val)
        order = torch.sort(val, dim=-1, descending=True, stable=True).indices[:, :top_k]
        chosen = torch.sort(order, dim=-1).values.to(torch.int32)
        out[:, i, : chosen.shape[1]] = chosen
    return out


def oracle_attention_rows(q, k, v, do, q2k, msa, rows, scale, bs=BS):
    """float64 out [S,Hq,d], lse [Hq,S], dq [S,Hq,d] for the query tokens ``rows``."""
    cu = msa.cu_seqlens.long()
    doc = msa.token_documents.long()[rows]
    pos = msa.document_positions.long()[rows]
    hq, hkv = q.shape[1], k.shape[1]
    grp = hq // hkv
    sel = q2k[:, rows].long()  # [Hkv, S, K]
    j = sel[..., None] * bs + torch.arange(bs, device=q.device)  # [Hkv, S, K, bs]
    vis = (sel[..., None] >= 0) & (j <= pos[None, :, None, None])
    krow = (cu[doc][None, :, None, None] + j).clamp(0, q.shape[0] - 1)
    gidx = torch.arange(hkv, device=q.device)[:, None, None, None]
    kk = k[krow, gidx].double().flatten(2, 3)  # [Hkv, S, K*bs, d]
    vv = v[krow, gidx].double().flatten(2, 3)
    vis = vis.flatten(2, 3)
    qs = q[rows].double().view(-1, hkv, grp, q.shape[2]).permute(1, 0, 2, 3)
    qs = qs.detach().requires_grad_(True)  # [Hkv, S, G, d]
    sc = torch.einsum("hsgd,hsjd->hsgj", qs, kk) * scale
    sc = sc.masked_fill(~vis[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(sc, -1)
    pr = torch.exp(sc - lse[..., None])
    o = torch.einsum("hsgj,hsjd->hsgd", pr, vv)
    dos = do[rows].double().view(-1, hkv, grp, q.shape[2]).permute(1, 0, 2, 3)
    (o * dos).sum().backward()
    out = o.detach().permute(1, 0, 2, 3).reshape(rows.numel(), hq, -1)
    dq = qs.grad.permute(1, 0, 2, 3).reshape(rows.numel(), hq, -1)
    lse = lse.detach().permute(0, 2, 1).reshape(hq, rows.numel())
    return out, lse, dq


def rel(x, ref):
    x = x.double()
    ref = ref.double()
    if not torch.isfinite(x).all():
        return float("nan")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------- flops


def selected_flops(q2k, msa, grp, d, bs=BS):
    """Forward FLOPs over the selected, causally visible keys (QK^T and PV, 2 each per MAC)."""
    pos = msa.document_positions.long()[None, :, None]
    b = q2k.long()
    visible = (pos - b * bs + 1).clamp(0, bs)
    visible = torch.where(b >= 0, visible, torch.zeros_like(visible))
    return float(visible.sum().item()) * grp * d * 4


def selection_flops(msa, hi, di):
    cu = msa.cu_seqlens.long().cpu()
    n = (cu[1:] - cu[:-1]).double()
    return float((n * (n + 1) / 2).sum()) * 2 * hi * di


def dense_flops(rows, seq_len, hq, d):
    # Dense baseline runs causal over each whole padded row (it knows no documents).
    return len(rows) * 2.0 * seq_len * seq_len * d * hq


# ----------------------------------------------------------------------------- timing


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Busy bf16 matmuls for ``seconds`` before the first timing, so that the first case is
    not measured while clocks ramp up (a fresh device showed a slow first row)."""
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def time_fn(fn, input_sets, min_reps=3, max_reps=40, budget_ms=1500.0, warmup=2):
    """Median ms of ``fn(inputs)`` over rotating input sets, CUDA events around each call."""
    for i in range(warmup):
        fn(input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(input_sets[0])
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    reps = int(max(min_reps, min(max_reps, budget_ms / max(est, 1e-3))))
    times = []
    for r in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        inp = input_sets[r % len(input_sets)]
        s.record()
        fn(inp)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times), reps


def peak_extra(fn, inputs, out_bytes=0):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = fn(inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - out_bytes
    del res
    return peak / 2**20


# ----------------------------------------------------------------------------- main


@contextlib.contextmanager
def deterministic_mode():
    """torch.use_deterministic_algorithms(True) for the block (the backward's atomic-free path)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def run_case(case, args, gen, results):
    from nemo_msa.attention.triton_bwd import triton_attention_backward
    from nemo_msa.attention.triton_fwd import triton_attention_forward
    from nemo_msa.selection.triton_select import triton_select_blocks

    msa = case["msa"]
    t = msa.num_tokens
    dev = msa.cu_seqlens.device
    scale = 1.0 / math.sqrt(D)
    r = {"case": case["name"], "tokens": t, "docs": msa.num_documents}

    def sel_fn(x):
        return triton_select_blocks(x["iq"], x["ik"], msa, top_k=TOPK, init_blocks=INIT,
                                    local_blocks=LOCAL)

    # --- correctness (fresh inputs)
    x = fresh_inputs(t, dev, gen)
    q2k = sel_fn(x)
    ns = min(args.subset, t)
    rows = torch.randperm(t, generator=gen, device=dev)[:ns].sort().values
    rows[-1] = t - 1  # always include the last token (most candidates)
    ref_sel = oracle_select_rows(x["iq"], x["ik"], msa, rows)
    r["sel_match_subset"] = (q2k[:, rows] == ref_sel).all(-1).float().mean().item()
    # The backward takes the forward's union lists, as through autograd (backends_triton).
    out, lse, unions = triton_attention_forward(x["q"], x["k"], x["v"], q2k, msa, scale,
                                                return_unions=True)
    dq, dk, dv = triton_attention_backward(x["do"], x["q"], x["k"], x["v"], out, lse, q2k, msa,
                                           scale, unions=unions)
    o_ref, l_ref, dq_ref = oracle_attention_rows(x["q"], x["k"], x["v"], x["do"], q2k, msa,
                                                 rows, scale)
    r["out_err_subset"] = rel(out[rows], o_ref)
    r["lse_err_subset"] = rel(lse[:, rows], l_ref)
    r["dq_err_subset"] = rel(dq[rows], dq_ref)
    if t <= args.full_check_max:
        from nemo_msa.attention.naive import (
            sparse_attention_backward_reference,
            sparse_attention_forward_reference,
        )
        from nemo_msa.selection.naive import select_blocks_reference

        ref_full = select_blocks_reference(x["iq"], x["ik"], msa, top_k=TOPK, init_blocks=INIT,
                                           local_blocks=LOCAL, score="max")
        r["sel_match_full"] = (q2k == ref_full).all(-1).float().mean().item()
        q64, k64, v64, do64 = (x[n].double() for n in ("q", "k", "v", "do"))
        o64, l64 = sparse_attention_forward_reference(q64, k64, v64, q2k, msa, scale)
        g64 = sparse_attention_backward_reference(do64, q64, k64, v64, o64, l64, q2k, msa,
                                                  scale)
        r["out_err_full"] = rel(out, o64)
        r["dq_err_full"], r["dk_err_full"], r["dv_err_full"] = (
            rel(a, b) for a, b in zip((dq, dk, dv), g64, strict=True))
        del q64, k64, v64, do64, o64, l64, g64
    # Determinism of the backward (bitwise) in deterministic mode (the atomic-free path).
    with deterministic_mode():
        runs = [triton_attention_backward(x["do"], x["q"], x["k"], x["v"], out, lse, q2k, msa,
                                          scale, unions=unions) for _ in range(2)]
    r["bwd_bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    r["dq_err_det_vs_default"] = rel(runs[0][0], dq)
    del out, lse, unions, dq, dk, dv, runs, x
    _log(json.dumps(r))

    # --- timing
    sets = [fresh_inputs(t, dev, gen) for _ in range(args.sets)]
    for s in sets:
        s["q2k"] = sel_fn(s)

    def fwd_fn(s, return_unions=False):
        return triton_attention_forward(s["q"], s["k"], s["v"], s["q2k"], msa, scale,
                                        return_unions=return_unions)

    for s in sets:
        s["out"], s["lse"], s["unions"] = fwd_fn(s, return_unions=True)

    def bwd_fn(s):
        return triton_attention_backward(s["do"], s["q"], s["k"], s["v"], s["out"], s["lse"],
                                         s["q2k"], msa, scale, unions=s["unions"])

    def msa_fwd(s):
        sel = sel_fn(s)
        return triton_attention_forward(s["q"], s["k"], s["v"], sel, msa, scale)

    def msa_fwdbwd(s):
        sel = sel_fn(s)
        o, lse_, unions_ = triton_attention_forward(s["q"], s["k"], s["v"], sel, msa, scale,
                                                    return_unions=True)
        return triton_attention_backward(s["do"], s["q"], s["k"], s["v"], o, lse_, sel, msa,
                                         scale, unions=unions_)

    if args.union_builds:
        r["union_build_ms"] = time_union_builds(args.union_builds, sets, msa)
    r["sel_ms"], _ = time_fn(sel_fn, sets)
    r["fwd_ms"], _ = time_fn(fwd_fn, sets)
    r["bwd_ms"], _ = time_fn(bwd_fn, sets)
    with deterministic_mode():
        r["bwd_det_ms"], _ = time_fn(bwd_fn, sets)
    r["msa_fwd_ms"], _ = time_fn(msa_fwd, sets)
    r["msa_fwdbwd_ms"], _ = time_fn(msa_fwdbwd, sets)
    r["sel_extra_mib"] = peak_extra(sel_fn, sets[0], out_bytes=HI * t * TOPK * 4)
    r["fwd_extra_mib"] = peak_extra(fwd_fn, sets[0], out_bytes=t * HQ * D * 2 + HQ * t * 4)
    r["bwd_extra_mib"] = peak_extra(bwd_fn, sets[0], out_bytes=t * (HQ + 2 * HKV) * D * 2)
    flops = sum(selected_flops(s["q2k"], msa, HQ // HKV, D) for s in sets) / len(sets)
    r["fwd_tflops"] = flops / r["fwd_ms"] / 1e9
    r["bwd_tflops"] = 2.5 * flops / r["bwd_ms"] / 1e9
    r["sel_tflops"] = selection_flops(msa, HI, DI) / r["sel_ms"] / 1e9
    if args.profile:
        profile_kernels(msa_fwdbwd, sets, case["name"])
    for s in sets:
        for n in ("out", "lse", "q2k"):
            s.pop(n)

    if args.no_dense:  # parameter sweeps: MSA times only, no ratio
        for key in ("dense_fwd_ms", "dense_fwdbwd_ms", "dense_tflops_fwd", "speedup_fwd",
                    "speedup_fwdbwd"):
            r[key] = float("nan")
        _log(json.dumps(r))
        results.append(r)
        return

    # --- dense cuDNN SDPA, causal over each padded row, GQA
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, sl = len(case["rows"]), case["seq_len"]
    dsets = []
    for _ in range(min(args.sets, 2)):
        dsets.append({n: torch.randn((b, h, sl, D), generator=gen, device=dev).to(
            torch.bfloat16) for n, h in (("q", HQ), ("k", HKV), ("v", HKV), ("do", HQ))})

    def dense_fwd(s):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                s["q"], s["k"], s["v"], is_causal=True, enable_gqa=True)

    def dense_fwdbwd(s):
        q_, k_, v_ = (s[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=True,
                                                                 enable_gqa=True)
        o.backward(s["do"])
        return q_.grad

    r["dense_fwd_ms"], _ = time_fn(dense_fwd, dsets, max_reps=10, budget_ms=3000)
    r["dense_fwdbwd_ms"], _ = time_fn(dense_fwdbwd, dsets, max_reps=6, budget_ms=6000)
    r["dense_tflops_fwd"] = dense_flops(case["rows"], sl, HQ, D) / r["dense_fwd_ms"] / 1e9
    r["speedup_fwd"] = r["dense_fwd_ms"] / r["msa_fwd_ms"]
    r["speedup_fwdbwd"] = r["dense_fwdbwd_ms"] / r["msa_fwdbwd_ms"]
    del sets, dsets
    torch.cuda.empty_cache()
    _log(json.dumps(r))
    results.append(r)


def time_union_builds(specs: str, sets, msa) -> dict:
    """Times the forward's union-list build alone for each ``build:tiles:warps`` in ``specs``
    (comma-separated; ``tiles`` and ``warps`` default to CONFIG's) on the sets' selections, at
    the tile size their forward used (``s["unions"]``), after checking that it gives the torch
    build's lists and counts; logs one line each."""
    import nemo_msa.attention.triton_fwd as tf
    from nemo_msa.attention.triton_layout import doc_blocks

    if sets[0]["unions"] is None:
        _log("union build: not timed, the forward's union kernel is off (union_qt 0)")
        return {}
    blocks = doc_blocks(msa, BS)
    qt = sets[0]["unions"].qt
    saved = dict(tf.CONFIG)
    try:
        tf.CONFIG["union_build"] = "torch"
        want = tf.tile_unions(sets[0]["q2k"], blocks, msa, qt)
        times = {}
        for spec in specs.split(","):
            build, *rest = spec.split(":")
            tf.CONFIG.update(saved, union_build=build)
            if rest:
                tf.CONFIG["union_build_tiles"] = int(rest[0])
            if len(rest) > 1:
                tf.CONFIG["union_build_warps"] = int(rest[1])
            got = tf.tile_unions(sets[0]["q2k"], blocks, msa, qt)
            same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            times[spec], _ = time_fn(lambda s: tf.tile_unions(s["q2k"], blocks, msa, qt), sets)
            _log(f"union build {spec}: {times[spec]:.3f} ms, equal to the torch build: {same}")
    finally:
        tf.CONFIG.clear()
        tf.CONFIG.update(saved)
    return times


def profile_kernels(fn, sets, name, reps=3):
    """Per-kernel GPU time of ``fn`` (selection, forward and backward of MSA) under
    torch.profiler: where the step's time goes, torch's sorts and copies included."""
    from torch.profiler import ProfilerActivity, profile

    fn(sets[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn(sets[i % len(sets)])
        torch.cuda.synchronize()
    _log(f"kernel profile of MSA fwd+bwd, {name}, {reps} calls (times are totals over them):")
    _log(prof.key_averages().table(sort_by="self_device_time_total", row_limit=16,
                                   max_name_column_width=60))


def sweep(args, gen):
    """Times launch-parameter variants on one shape; prints one line per variant."""
    import nemo_msa.attention.triton_bwd as tb
    import nemo_msa.attention.triton_fwd as tf
    import nemo_msa.selection.triton_select as ts
    from nemo_msa.attention.triton_layout import block_query_csr, doc_blocks

    case = make_case("sweep", [[args.sweep_size]], args.sweep_size, "cuda")
    msa = case["msa"]
    t = msa.num_tokens
    scale = 1.0 / math.sqrt(D)
    sets = [fresh_inputs(t, "cuda", gen) for _ in range(2)]
    for s in sets:
        s["q2k"] = ts.triton_select_blocks(s["iq"], s["ik"], msa, top_k=TOPK, init_blocks=INIT,
                                           local_blocks=LOCAL)
        s["out"], s["lse"] = tf.triton_attention_forward(s["q"], s["k"], s["v"], s["q2k"], msa,
                                                         scale)
    flops = selected_flops(sets[0]["q2k"], msa, HQ // HKV, D)
    sflops = selection_flops(msa, HI, DI)
    lines = []

    def trial(kind, mod, cfg, fn, fl):
        old = dict(mod.CONFIG)
        mod.CONFIG.update(cfg)
        try:
            ms, _ = time_fn(fn, sets, max_reps=15, budget_ms=800)
            lines.append(f"{kind:5s} {json.dumps(cfg):70s} {ms:9.3f} ms {fl / ms / 1e9:7.1f} TF/s")
            assert lines[-1].split()[-4] == f"{ms:.3f}"
        except Exception as exc:  # a variant that fails to compile is reported, not fatal
            lines.append(f"{kind:5s} {json.dumps(cfg):70s} FAILED {type(exc).__name__}: "
                         f"{str(exc)[:80]}")
        finally:
            mod.CONFIG.clear()
            mod.CONFIG.update(old)
        _log(lines[-1])

    def sel(s):
        return ts.triton_select_blocks(s["iq"], s["ik"], msa, top_k=TOPK, init_blocks=INIT,
                                       local_blocks=LOCAL)

    def fwd(s):
        return tf.triton_attention_forward(s["q"], s["k"], s["v"], s["q2k"], msa, scale)

    def bwd(s):
        return tb.triton_attention_backward(s["do"], s["q"], s["k"], s["v"], s["out"], s["lse"],
                                            s["q2k"], msa, scale)

    best = {}

    def keep(kind, mod, cfg):
        ms = float(lines[-1].split()[-4]) if "FAILED" not in lines[-1] else float("inf")
        if ms < best.get(kind, (float("inf"),))[0]:
            best[kind] = (ms, mod, cfg)

    for bm, bn, w, st in ((128, 128, 4, 2), (128, 128, 8, 2)):
        cfg = {"bm": bm, "bn": bn, "num_warps": w, "num_stages": st}
        trial("sel", ts, cfg, sel, sflops)
        keep("sel", ts, cfg)
    for bn, w, st in ((128, 4, 2), (128, 8, 2), (64, 4, 2), (128, 4, 3), (64, 4, 3)):
        cfg = {"bn": bn, "num_warps": w, "num_stages": st}
        trial("fwd", tf, cfg, fwd, flops)
        keep("fwd", tf, cfg)
    for qt, w in ((4, 4), (8, 8), (4, 8)):
        cfg = {"bn": 128, "num_warps": w, "num_stages": 2, "union_qt": qt}
        trial("fwd", tf, cfg, fwd, flops)
        keep("fwd", tf, cfg)
    # Coherent selections (what a trained indexer gives: neighbouring queries pick mostly the
    # same blocks): index q = one random vector per 128-token block + 5% noise. Attention
    # inputs stay random; only q2k changes. Reported, never used to pick the defaults.
    coh = []
    for s in sets:
        base = torch.randn((t // BS + 1, HI, DI), generator=gen, device="cuda")
        iq = (base[torch.arange(t, device="cuda") // BS]
              + 0.05 * torch.randn((t, HI, DI), generator=gen, device="cuda")).to(torch.bfloat16)
        c = dict(s)
        c["q2k"] = ts.triton_select_blocks(iq, s["ik"], msa, top_k=TOPK, init_blocks=INIT,
                                           local_blocks=LOCAL)
        coh.append(c)
    cflops = selected_flops(coh[0]["q2k"], msa, HQ // HKV, D)
    from nemo_msa.attention.triton_fwd import tile_unions as _tu

    for qt in (4, 8):
        _, cnt = _tu(coh[0]["q2k"], doc_blocks(msa, BS), msa, qt)
        _, rcnt = _tu(sets[0]["q2k"], doc_blocks(msa, BS), msa, qt)
        lines.append(f"union {qt} tokens/tile: mean union blocks coherent "
                     f"{cnt[cnt > 0].float().mean().item():.1f}, random "
                     f"{rcnt[rcnt > 0].float().mean().item():.1f} (per token: 16)")
        _log(lines[-1])
    saved_sets = sets
    sets = coh
    for qt, w in ((0, 4), (4, 4), (8, 8)):
        cfg = {"bn": 128, "num_warps": w, "num_stages": 2, "union_qt": qt}
        trial("fwdC", tf, cfg, fwd, cflops)
    sets = saved_sets
    for dbn, dw, dst in ((64, 4, 2), (128, 4, 2), (128, 8, 2), (64, 8, 2)):
        cfg = {"dq_bn": dbn, "dq_warps": dw, "dq_stages": dst}
        trial("bwd", tb, cfg, bwd, 2.5 * flops)
        keep("bwd", tb, cfg)
    if "bwd" in best:
        tb.CONFIG.update(best["bwd"][2])  # the dk/dv variants below run with the best dq
    for kbn, rows, w, st in ((64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2)):
        cfg = {"kv_bn": kbn, "kv_rows": rows, "kv_warps": w, "kv_stages": st}
        trial("bwd", tb, cfg, bwd, 2.5 * flops)
        if "bwd" in best and "FAILED" not in lines[-1] \
                and float(lines[-1].split()[-4]) < best["bwd"][0]:
            best["bwd"] = (float(lines[-1].split()[-4]), tb, {**best["bwd"][2], **cfg})
    # Breakdown of the backward (best dq parameters).
    trial("bwd", tb, {"skip": "dkdv"}, bwd, 1.0 * flops)  # dq kernel + CSR build
    trial("bwd", tb, {"skip": "dq"}, bwd, 1.5 * flops)  # CSR build + dk/dv kernel
    def csr(s):
        return block_query_csr(s["q2k"], doc_blocks(msa, BS), msa)

    ms, _ = time_fn(csr, sets, max_reps=15, budget_ms=500)
    lines.append(f"csr   block->queries CSR build (torch sort)  {ms:9.3f} ms")
    _log(lines[-1])
    if args.apply_best:
        for kind, (ms, mod, cfg) in best.items():
            mod.CONFIG.update(cfg)
            lines.append(f"apply {kind} {json.dumps(cfg)} ({ms:.3f} ms)")
            _log(lines[-1])
    return lines


def fmt_table(results, notes):
    head = ("| case | tokens | sel ms | fwd ms | bwd ms | bwd det ms | MSA fwd ms | MSA f+b ms "
            "| dense fwd ms "
            "| dense f+b ms | speedup fwd | speedup f+b | fwd TF/s | bwd TF/s | sel TF/s "
            "| sel extra MiB | fwd extra MiB | bwd extra MiB | sel match | out err | dq err "
            "| dk err | dv err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        match = f"{r['sel_match_subset']:.4f}s"
        if "sel_match_full" in r:
            match += f" / {r['sel_match_full']:.4f}f"
        out_err = f"{r['out_err_subset']:.1e}s"
        dq_err = f"{r['dq_err_subset']:.1e}s"
        dk_err = dv_err = "n/a"
        if "out_err_full" in r:
            out_err += f" {r['out_err_full']:.1e}f"
            dq_err += f" {r['dq_err_full']:.1e}f"
            dk_err = f"{r['dk_err_full']:.1e}f"
            dv_err = f"{r['dv_err_full']:.1e}f"
        lines.append(
            f"| {r['case']} | {r['tokens']} | {r['sel_ms']:.2f} | {r['fwd_ms']:.2f} "
            f"| {r['bwd_ms']:.2f} | {r['bwd_det_ms']:.2f} | {r['msa_fwd_ms']:.2f} "
            f"| {r['msa_fwdbwd_ms']:.2f} "
            f"| {r['dense_fwd_ms']:.2f} | {r['dense_fwdbwd_ms']:.2f} | {r['speedup_fwd']:.2f}x "
            f"| {r['speedup_fwdbwd']:.2f}x | {r['fwd_tflops']:.0f} | {r['bwd_tflops']:.0f} "
            f"| {r['sel_tflops']:.0f} | {r['sel_extra_mib']:.1f} | {r['fwd_extra_mib']:.1f} "
            f"| {r['bwd_extra_mib']:.1f} | {match} | {out_err} | {dq_err} | {dk_err} "
            f"| {dv_err} |")
    return "\n".join(lines + [""] + notes)


def apply_overrides(items: list[str]) -> None:
    """Applies ``--set KERNEL.KEY=VALUE`` to the kernels' CONFIG dicts (values parsed as JSON;
    a value that is not JSON, such as ``triton``, is taken as a string)."""
    import nemo_msa.attention.triton_bwd as tb
    import nemo_msa.attention.triton_fwd as tf
    import nemo_msa.selection.triton_select as ts

    configs = {"sel": ts.CONFIG, "fwd": tf.CONFIG, "bwd": tb.CONFIG}
    for item in items:
        name, _, value = item.partition("=")
        kernel, _, key = name.partition(".")
        if kernel not in configs or key not in configs[kernel] or not value:
            known = {k: sorted(c) for k, c in configs.items()}
            sys.exit(f"--set {item!r}: expected KERNEL.KEY=VALUE with KEY one of {known}")
        try:
            configs[kernel][key] = json.loads(value)
        except json.JSONDecodeError:
            configs[kernel][key] = value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8192,32768,65536,131072")
    ap.add_argument("--packed", type=int, default=32768, help="packed case tokens (0 = none)")
    ap.add_argument("--subset", type=int, default=96, help="query rows of the subset oracles")
    ap.add_argument("--full-check-max", type=int, default=32768,
                    help="largest token count checked in full against the package reference")
    ap.add_argument("--sets", type=int, default=3, help="fresh input sets rotated in timing")
    ap.add_argument("--sweep", action="store_true", help="time launch-parameter variants first")
    ap.add_argument("--sweep-size", type=int, default=32768)
    ap.add_argument("--apply-best", action="store_true",
                    help="run the table with the fastest swept launch parameters")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write all results to this file")
    ap.add_argument("--coherent", action="store_true",
                    help="index q shared within each 128-token block (+5%% noise): selections "
                    "like a trained indexer's; attention inputs stay random")
    ap.add_argument("--union-qt", type=int, default=None,
                    help="override the forward's union tile (0 = per-token kernel only)")
    ap.add_argument("--dq-union-qt", type=int, default=None,
                    help="override the dq union tile (0 = per-token dq kernel only)")
    ap.add_argument("--profile", action="store_true",
                    help="also print a per-kernel torch.profiler table of MSA fwd+bwd per case")
    ap.add_argument("--union-builds", default="",
                    help="also time the union-list build alone per build:tiles:warps, "
                    "comma-separated (e.g. triton,triton_scan:4:4)")
    ap.add_argument("--no-dense", action="store_true",
                    help="skip the dense baseline (launch-parameter sweeps; no speedup ratios)")
    ap.add_argument("--set", action="append", default=[], metavar="KERNEL.KEY=VALUE",
                    help="override one launch parameter, e.g. fwd.union_max=48 or "
                    "bwd.dq_union_warps=4 (KERNEL is sel, fwd or bwd; repeatable)")
    args = ap.parse_args(argv)
    apply_overrides(args.set)
    global COHERENT
    COHERENT = args.coherent
    if args.union_qt is not None:
        import nemo_msa.attention.triton_fwd as tf

        tf.CONFIG["union_qt"] = args.union_qt
    if args.dq_union_qt is not None:
        import nemo_msa.attention.triton_bwd as tb

        tb.CONFIG["dq_union_qt"] = args.dq_union_qt
    if not torch.cuda.is_available():
        sys.exit("bench_msa.py needs a CUDA GPU (the CPU kernel tests live in tests/msa_kernels)")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    host_gen = torch.Generator().manual_seed(args.seed)
    props = torch.cuda.get_device_properties(0)
    import nemo_msa.attention.triton_bwd as tb
    import nemo_msa.attention.triton_fwd as tf
    import nemo_msa.selection.triton_select as ts

    _log(f"GPU {props.name}, torch {torch.__version__}, triton "
         f"{__import__('triton').__version__}; coherent={COHERENT}; configs: sel {ts.CONFIG} "
         f"fwd {tf.CONFIG} bwd {tb.CONFIG}")
    warm_up_gpu()
    sweep_lines = sweep(args, gen) if args.sweep else []
    cases = [make_case(f"doc{n}", [[n]], n, "cuda") for n in
             (int(s) for s in args.sizes.split(",") if s)]
    if args.packed:
        rows = packed_rows(args.packed, 1024, 16384, 16384, host_gen)
        cases.append(make_case(f"packed{args.packed}", rows, 16384, "cuda"))
        _log("packed rows (doc lengths):", rows)
    results = []
    for case in cases:
        run_case(case, args, gen, results)
    notes = [
        "index inputs: "
        + ("coherent (shared per 128-token block + 5% noise)" if COHERENT else "random")
        + f"; forward union_qt={tf.CONFIG['union_qt']}, union_max={tf.CONFIG['union_max']}"
        + f"; dq union_qt={tb.CONFIG['dq_union_qt']}, union_max={tb.CONFIG['dq_union_max']}"
        + " (the backward takes the forward's union lists, as through autograd)"
        + (f"; overrides {args.set}" if args.set else "") + ".",
        "s = checked on a random subset of query rows (incl. the last) against float64; "
        "f = all rows against the package reference (selection in fp32, attention in float64).",
        "TF/s: fwd on selected, causally visible block FLOPs (4 d G per key); bwd counts 2.5x "
        "fwd; sel counts 2 H d per causal (q, k) pair. Dense runs causal over each padded row.",
        "extra MiB: peak allocation during the call beyond inputs and outputs.",
    ]
    if sweep_lines:
        _log("\nsweep (" + str(args.sweep_size) + " tokens):")
        for line in sweep_lines:
            _log(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "sweep": sweep_lines}, f, indent=1)
    _log("\n" + fmt_table(results, notes))


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    main()
