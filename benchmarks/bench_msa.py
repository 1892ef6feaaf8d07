"""Checks and times the Triton MSA kernels against float64 and dense cuDNN SDPA.

For each case (single documents of 8192..131072 tokens, a packed batch of mixed documents):

1. correctness, fresh random inputs:
   * selection: exact-match fraction of rows vs a float64 brute-force oracle on a random subset
     of query tokens (all sizes), and vs the package reference (``select_blocks_reference``)
     on all rows where it is affordable (``--full-check-max`` tokens);
   * forward out/lse and dq: relative norm error vs float64 on a query subset (rows of
     different tokens are independent, so the subset is exact);
   * full out/dq/dk/dv vs the package reference run in float64 where affordable;
   * the backward in deterministic mode twice: bitwise equal?
2. timing with CUDA events (median of many runs after warm-up, inputs rotated among several
   fresh random sets): selection, sparse forward (also with the block mass), sparse backward,
   MSA forward (selection + forward), MSA forward+backward, the backward again in
   deterministic mode ("bwd det"), dense cuDNN SDPA (causal, enable_gqa) forward and
   forward+backward on the same shapes;
3. one table, printed last: times, speedups, effective TFLOP/s (selected-block FLOPs), peak
   extra memory.

Usage (on the GPU)::

    python benchmarks/bench_msa.py [--sizes 8192,32768,65536,131072] [--packed 32768] [--sweep]
        [--set KERNEL.KEY=VALUE ...]

It needs a CUDA GPU; the CPU checks of the same kernels are tests/msa_kernels (interpreter).
The parts: benchmarks/msa_bench (cases, timing, sweep, report); the float64 oracles:
nemo_msa.testing.oracle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from msa_bench.cases import (  # noqa: E402
    BS,
    DI,
    HI,
    HKV,
    HQ,
    INIT,
    LOCAL,
    TOPK,
    D,
    dense_flops,
    fresh_inputs,
    make_case,
    packed_rows,
    selected_flops,
    selection_flops,
)
from msa_bench.report import fmt_notes, fmt_sweep_line, fmt_table  # noqa: E402
from msa_bench.timing import (  # noqa: E402
    deterministic_mode,
    log,
    peak_extra,
    profile_kernels,
    time_fn,
    warm_up_gpu,
)


def check_case(msa, x, args, gen, sel_fn, scale) -> dict:
    """Correctness of one case on fresh inputs ``x``: subset oracles, full references where
    affordable, and the deterministic backward's repeatability."""
    from nemo_msa.attention.triton_bwd import triton_attention_backward
    from nemo_msa.attention.triton_fwd import triton_attention_forward
    from nemo_msa.testing.oracle import attention_rows_f64, rel_err, select_rows_f64

    t = msa.num_tokens
    dev = msa.cu_seqlens.device
    r = {}
    q2k = sel_fn(x)
    ns = min(args.subset, t)
    rows = torch.randperm(t, generator=gen, device=dev)[:ns].sort().values
    rows[-1] = t - 1  # always include the last token (most candidates)
    ref_sel = select_rows_f64(x["iq"], x["ik"], msa, rows, top_k=TOPK, init_blocks=INIT,
                              local_blocks=LOCAL, block_size=BS)
    r["sel_match_subset"] = (q2k[:, rows] == ref_sel).all(-1).float().mean().item()
    # The backward takes the forward's union lists, as through autograd (nemo_msa.backends.triton).
    out, lse, unions = triton_attention_forward(x["q"], x["k"], x["v"], q2k, msa, scale,
                                                return_unions=True)
    dq, dk, dv = triton_attention_backward(x["do"], x["q"], x["k"], x["v"], out, lse, q2k, msa,
                                           scale, unions=unions)
    o_ref, l_ref, dq_ref = attention_rows_f64(x["q"], x["k"], x["v"], x["do"], q2k, msa, rows,
                                              scale, BS)
    r["out_err_subset"] = rel_err(out[rows], o_ref)
    r["lse_err_subset"] = rel_err(lse[:, rows], l_ref)
    r["dq_err_subset"] = rel_err(dq[rows], dq_ref)
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
        r["out_err_full"] = rel_err(out, o64)
        r["dq_err_full"], r["dk_err_full"], r["dv_err_full"] = (
            rel_err(a, b) for a, b in zip((dq, dk, dv), g64, strict=True))
    with deterministic_mode():
        runs = [triton_attention_backward(x["do"], x["q"], x["k"], x["v"], out, lse, q2k, msa,
                                          scale, unions=unions) for _ in range(2)]
    r["bwd_bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    r["dq_err_det_vs_default"] = rel_err(runs[0][0], dq)
    return r


def time_dense(case, args, gen, r) -> None:
    """Dense cuDNN SDPA, causal over each padded row with GQA: fills the dense times and the
    speedups of ``r``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = case["msa"].cu_seqlens.device
    b, sl = len(case["rows"]), case["seq_len"]
    dsets = [{n: torch.randn((b, h, sl, D), generator=gen, device=dev).to(torch.bfloat16)
              for n, h in (("q", HQ), ("k", HKV), ("v", HKV), ("do", HQ))}
             for _ in range(min(args.sets, 2))]

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


def run_case(case, args, gen) -> dict:
    """Checks and times one case; returns its result row."""
    from msa_bench.sweep import time_union_builds

    from nemo_msa.attention.triton_bwd import triton_attention_backward
    from nemo_msa.attention.triton_fwd import triton_attention_forward
    from nemo_msa.indexer_loss.triton_byproducts import block_scores_triton
    from nemo_msa.selection.triton_select import triton_select_blocks
    from nemo_msa.triton.launch import current_launch

    msa = case["msa"]
    t = msa.num_tokens
    dev = msa.cu_seqlens.device
    scale = 1.0 / math.sqrt(D)
    r = {"case": case["name"], "tokens": t, "docs": msa.num_documents}

    def sel_fn(x):
        return triton_select_blocks(x["iq"], x["ik"], msa, top_k=TOPK, init_blocks=INIT,
                                    local_blocks=LOCAL)

    r.update(check_case(msa, fresh_inputs(t, dev, gen, args.coherent), args, gen, sel_fn,
                        scale))
    log(json.dumps(r))

    sets = [fresh_inputs(t, dev, gen, args.coherent) for _ in range(args.sets)]
    for s in sets:
        s["q2k"] = sel_fn(s)

    def scores_fn(x):
        # The sparse indexer loss's scores and argmax keys of the selected blocks (ADR 0033).
        return block_scores_triton(x["iq"], x["ik"], x["q2k"], msa)

    def fwd_fn(s, return_unions=False):
        return triton_attention_forward(s["q"], s["k"], s["v"], s["q2k"], msa, scale,
                                        return_unions=return_unions)

    for s in sets:
        s["out"], s["lse"], s["unions"] = fwd_fn(s, return_unions=True)

    def fwd_mass_fn(s):
        # The layer's forward under the sparse indexer loss: the block mass comes with it.
        return triton_attention_forward(s["q"], s["k"], s["v"], s["q2k"], msa, scale,
                                        return_block_mass=True)

    def bwd_fn(s):
        return triton_attention_backward(s["do"], s["q"], s["k"], s["v"], s["out"], s["lse"],
                                         s["q2k"], msa, scale, unions=s["unions"])

    def msa_fwd(s):
        return triton_attention_forward(s["q"], s["k"], s["v"], sel_fn(s), msa, scale)

    def msa_fwdbwd(s):
        sel = sel_fn(s)
        o, lse_, unions_ = triton_attention_forward(s["q"], s["k"], s["v"], sel, msa, scale,
                                                    return_unions=True)
        return triton_attention_backward(s["do"], s["q"], s["k"], s["v"], o, lse_, sel, msa,
                                         scale, unions=unions_)

    if args.union_builds:
        r["union_build_ms"] = time_union_builds(args.union_builds, sets, msa,
                                                current_launch("fwd"))
    r["sel_ms"], _ = time_fn(sel_fn, sets)
    r["scores_ms"], _ = time_fn(scores_fn, sets)
    r["fwd_ms"], _ = time_fn(fwd_fn, sets)
    r["fwd_mass_ms"], _ = time_fn(fwd_mass_fn, sets)
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
        profile_kernels(fwd_mass_fn, sets, case["name"] + " forward with block mass")
    del sets
    if args.no_dense:  # parameter sweeps: MSA times only, no ratio
        for key in ("dense_fwd_ms", "dense_fwdbwd_ms", "dense_tflops_fwd", "speedup_fwd",
                    "speedup_fwdbwd"):
            r[key] = float("nan")
    else:
        time_dense(case, args, gen, r)
    torch.cuda.empty_cache()
    log(json.dumps(r))
    return r


def parse_overrides(items: list[str]) -> dict:
    """``--set KERNEL.KEY=VALUE`` items -> ``{"KERNEL.KEY": value}`` (values parsed as JSON; a
    value that is not JSON, such as ``dq``, is taken as a string), validated against the
    launch dataclasses; exits naming the bad item."""
    from nemo_msa.triton.launch import apply_settings, current_launch, parse_setting

    settings = {}
    for item in items:
        try:
            name, value = parse_setting(item)
            apply_settings({k: current_launch(k) for k in ("sel", "fwd", "bwd")},
                           {name: value})
        except ValueError as exc:
            sys.exit(f"--set {item!r}: expected KERNEL.KEY=VALUE with a known KERNEL.KEY and a "
                     f"value of its type ({exc})")
        settings[name] = value
    return settings


def apply_overrides(items: list[str]) -> contextlib.AbstractContextManager:
    """The ``launch_overrides`` block of ``--set`` items (see :func:`parse_overrides`)."""
    from nemo_msa.triton.launch import launch_overrides

    return launch_overrides(parse_overrides(items))


def build_parser() -> argparse.ArgumentParser:
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
                    help="also time the union-list build alone per tiles:warps, "
                    "comma-separated (e.g. 1:1,4:4)")
    ap.add_argument("--no-dense", action="store_true",
                    help="skip the dense baseline (launch-parameter sweeps; no speedup ratios)")
    ap.add_argument("--set", action="append", default=[], metavar="KERNEL.KEY=VALUE",
                    help="override one launch parameter, e.g. fwd.union_max=48 or "
                    "bwd.dq_union_warps=4 (KERNEL is sel, fwd or bwd; repeatable)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    settings = parse_overrides(args.set)
    if args.union_qt is not None:
        settings["fwd.union_qt"] = args.union_qt
    if args.dq_union_qt is not None:
        settings["bwd.dq_union_qt"] = args.dq_union_qt
    if not torch.cuda.is_available():
        sys.exit("bench_msa.py needs a CUDA GPU (the CPU kernel tests live in tests/msa_kernels)")
    from msa_bench.sweep import sweep

    from nemo_msa.triton.launch import launch_overrides

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    host_gen = torch.Generator().manual_seed(args.seed)
    props = torch.cuda.get_device_properties(0)
    with launch_overrides(settings) as launches:
        log(f"GPU {props.name}, torch {torch.__version__}, triton "
            f"{__import__('triton').__version__}; coherent={args.coherent}; launches: "
            + "; ".join(f"{k} {v}" for k, v in launches.items()))
        warm_up_gpu()
        trials, best = sweep(args.sweep_size, gen) if args.sweep else ([], {})
    if args.apply_best:
        settings = {**settings, **best}
        log(f"apply {json.dumps(best)}")
    cases = [make_case(f"doc{n}", [[n]], n, "cuda") for n in
             (int(s) for s in args.sizes.split(",") if s)]
    if args.packed:
        rows = packed_rows(args.packed, 1024, 16384, 16384, host_gen)
        cases.append(make_case(f"packed{args.packed}", rows, 16384, "cuda"))
        log("packed rows (doc lengths):", rows)
    with launch_overrides(settings) as launches:
        results = [run_case(case, args, gen) for case in cases]
        notes = fmt_notes(args.coherent, launches, args.set)
    if trials:
        log("\nsweep (" + str(args.sweep_size) + " tokens):")
        for trial in trials:
            if "settings" in trial:
                log(fmt_sweep_line(trial))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "sweep": trials, "best": best}, f, indent=1)
    log("\n" + fmt_table(results, notes))


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    main()
