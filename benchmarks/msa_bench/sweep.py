"""Launch-parameter sweeps on the GPU: each variant timed against the others of the same call.

Every trial runs inside :func:`~nemo_msa.triton.launch.launch_overrides`, so a
variant changes nothing after it; results come back as dicts (the caller prints them).
"""

from __future__ import annotations

import math

import torch
from msa_bench.cases import (
    BS,
    DI,
    HI,
    HKV,
    HQ,
    INIT,
    LOCAL,
    TOPK,
    D,
    coherent_index_q,
    fresh_inputs,
    make_case,
    selected_flops,
    selection_flops,
)
from msa_bench.report import fmt_sweep_line
from msa_bench.timing import log, time_fn

from nemo_msa.triton.launch import launch_overrides


def _trial(kind, settings, fn, flops, sets, trials):
    """Times ``fn`` over ``sets`` with ``settings`` (``{"KEY": value}`` of launch ``kind``);
    appends and logs the trial, and returns it. A variant that fails to compile is recorded,
    not fatal."""
    launch_kind = kind.rstrip("C")  # "fwdC": the forward on coherent selections
    trial = {"kind": kind, "settings": settings}
    try:
        with launch_overrides({f"{launch_kind}.{k}": v for k, v in settings.items()}):
            ms, _ = time_fn(fn, sets, max_reps=15, budget_ms=800)
        trial.update(ms=ms, tflops=flops / ms / 1e9)
    except Exception as exc:  # noqa: BLE001 - reported per variant
        trial.update(ms=math.inf, error=f"{type(exc).__name__}: {str(exc)[:80]}")
    trials.append(trial)
    log(fmt_sweep_line(trial))
    return trial


def sweep(size, gen):
    """Times launch-parameter variants on one document of ``size`` tokens.

    Returns:
        ``(trials, best)``: every trial (dicts with ``kind``, ``settings``, ``ms``, and
        ``tflops`` or ``error``) and the fastest settings per launch kind (``{"sel.bm": 128,
        ...}``), random selections only.
    """
    from nemo_msa.attention.triton_bwd import triton_attention_backward
    from nemo_msa.attention.triton_fwd import triton_attention_forward
    from nemo_msa.attention.triton_union import tile_unions
    from nemo_msa.selection.triton_select import triton_select_blocks
    from nemo_msa.triton.kernel_layout import block_query_csr, kernel_layout

    msa = make_case("sweep", [[size]], size, "cuda")["msa"]
    t = msa.num_tokens
    scale = 1.0 / math.sqrt(D)

    def sel(s):
        return triton_select_blocks(s["iq"], s["ik"], msa, top_k=TOPK, init_blocks=INIT,
                                    local_blocks=LOCAL)

    def fwd(s):
        return triton_attention_forward(s["q"], s["k"], s["v"], s["q2k"], msa, scale)

    def bwd(s):
        return triton_attention_backward(s["do"], s["q"], s["k"], s["v"], s["out"], s["lse"],
                                         s["q2k"], msa, scale)

    sets = [fresh_inputs(t, "cuda", gen) for _ in range(2)]
    for s in sets:
        s["q2k"] = sel(s)
        s["out"], s["lse"] = fwd(s)
    flops = selected_flops(sets[0]["q2k"], msa, HQ // HKV, D)
    trials, best = [], {}

    def keep(trial):
        if trial["ms"] < best.get(trial["kind"], (math.inf, {}))[0]:
            best[trial["kind"]] = (trial["ms"], trial["settings"])

    for bm, bn, w, st in ((128, 128, 4, 2), (128, 128, 8, 2)):
        keep(_trial("sel", {"bm": bm, "bn": bn, "num_warps": w, "num_stages": st}, sel,
                    selection_flops(msa, HI, DI), sets, trials))
    for bn, w, st in ((128, 4, 2), (128, 8, 2), (64, 4, 2), (128, 4, 3), (64, 4, 3)):
        keep(_trial("fwd", {"bn": bn, "num_warps": w, "num_stages": st}, fwd, flops, sets,
                    trials))
    for qt, w in ((4, 4), (8, 8), (4, 8)):
        keep(_trial("fwd", {"bn": 128, "num_warps": w, "num_stages": 2, "union_qt": qt}, fwd,
                    flops, sets, trials))
    # Coherent selections (as a trained indexer gives): reported, never used for the defaults.
    coh = []
    for s in sets:
        c = dict(s)
        c["q2k"] = sel({"iq": coherent_index_q(t, "cuda", gen), "ik": s["ik"]})
        coh.append(c)
    view = kernel_layout(msa, BS)
    for qt in (4, 8):
        _, cnt = tile_unions(coh[0]["q2k"], view, qt)
        _, rcnt = tile_unions(sets[0]["q2k"], view, qt)
        trials.append({"kind": "union", "qt": qt,
                       "mean_union_coherent": cnt[cnt > 0].float().mean().item(),
                       "mean_union_random": rcnt[rcnt > 0].float().mean().item()})
        log(f"union {qt} tokens/tile: mean union blocks coherent "
            f"{trials[-1]['mean_union_coherent']:.1f}, random "
            f"{trials[-1]['mean_union_random']:.1f} (per token: 16)")
    cflops = selected_flops(coh[0]["q2k"], msa, HQ // HKV, D)
    for qt, w in ((0, 4), (4, 4), (8, 8)):
        _trial("fwdC", {"bn": 128, "num_warps": w, "num_stages": 2, "union_qt": qt}, fwd,
               cflops, coh, trials)
    for dbn, dw, dst in ((64, 4, 2), (128, 4, 2), (128, 8, 2), (64, 8, 2)):
        keep(_trial("bwd", {"dq_bn": dbn, "dq_warps": dw, "dq_stages": dst}, bwd, 2.5 * flops,
                    sets, trials))
    dq_best = best.get("bwd", (math.inf, {}))[1]  # the dk/dv variants run with the best dq
    for kbn, rows, w, st in ((64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2)):
        keep(_trial("bwd", {**dq_best, "kv_bn": kbn, "kv_rows": rows, "kv_warps": w,
                            "kv_stages": st}, bwd, 2.5 * flops, sets, trials))
    ms, _ = time_fn(lambda s: block_query_csr(s["q2k"], view), sets, max_reps=15,
                    budget_ms=500)
    trials.append({"kind": "csr", "ms": ms})
    log(f"csr   block->queries CSR build (torch sort)  {ms:9.3f} ms")
    settings = {f"{kind}.{k}": v for kind, (_, cfg) in best.items() for k, v in cfg.items()}
    return trials, settings


def time_union_builds(specs: str, sets, msa, fwd) -> dict:
    """Times the forward's union-list build alone for each ``tiles:warps`` in ``specs``
    (comma-separated; a part left out is ``fwd``'s) on the sets' selections, at the tile size
    their forward used (``s["unions"]``), after checking it against the torch reference's
    lists and counts; logs one line each and returns ``{spec: ms}``."""
    from nemo_msa.attention.triton_union import tile_unions
    from nemo_msa.testing.oracle import tile_unions_reference
    from nemo_msa.triton.kernel_layout import kernel_layout

    if sets[0]["unions"] is None:
        log("union build: not timed, the forward's union kernel is off (union_qt 0)")
        return {}
    view = kernel_layout(msa, BS)
    qt = sets[0]["unions"].qt
    want = tile_unions_reference(sets[0]["q2k"], view, qt)
    times = {}
    for spec in specs.split(","):
        parts = [p for p in spec.split(":") if p != "triton_scan"]
        tiles = int(parts[0]) if parts else fwd.union_build_tiles
        warps = int(parts[1]) if len(parts) > 1 else fwd.union_build_warps

        def build(s, tiles=tiles, warps=warps):
            return tile_unions(s["q2k"], view, qt, tiles_per_program=tiles, warps=warps)

        same = all(torch.equal(a, b) for a, b in zip(build(sets[0]), want, strict=True))
        times[spec], _ = time_fn(build, sets)
        log(f"union build {spec}: {times[spec]:.3f} ms, equal to the torch reference: {same}")
    return times
