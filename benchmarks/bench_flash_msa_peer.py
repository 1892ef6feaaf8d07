"""Times poolside's flash-msa beside our Triton MSA op and cuDNN SDPA on the same inputs.

Per case (one document per row, MiniMax-M3 shape: 64 query / 4 KV heads, d = 128, 4 index heads
of 128, 128-token blocks, top-16 blocks; index queries random or coherent, see bench_msa.py):

- ours, the layer's path with ``msa_indexer_loss_type: sparse``: ``select_blocks(...)`` +
  ``document_attention(..., return_block_mass=True)`` +
  ``sparse_indexer_loss_from_byproducts``; forward, and forward + backward of output and loss;
- flash-msa: ``flash_msa_func`` forward (selection + attention; its KL is a placeholder), and
  forward + backward of output and ``kl_loss`` in one autograd call (the KL gradient), after a
  first call per input set timed apart (JIT compiles included: its backward is compiled per
  reverse-index task count); its selection alone;
- cuDNN SDPA, causal over each row, GQA: the common baseline;
- checks on the first input set: the share of (head, token) selections that agree, each side's
  output and dq against float64 with its own selection (query-row subset), flash-msa's index
  query gradient against a float64 reference of its token-level KL, and the two outputs against
  each other where the selections agree.

Semantic differences: benchmarks/msa_bench/flash_msa_peer.py and docs/adr/0029-flash-msa-peer.md.
Every step is caught and its error stored in the JSON and the table; a case's JSON is written as
soon as it ends.

Usage (on the GPU; the peer's wheels installed with ``pip install --target DIR``)::

    python benchmarks/bench_flash_msa_peer.py --site DIR [--sizes 32768,131072]
        [--inputs coherent,random] [--json peer.json]

Exit status 2, with one line naming the missing module, where flash-msa cannot be imported.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import sysconfig
import time
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
    fresh_inputs,
    make_case,
)
from msa_bench.flash_msa_peer import (  # noqa: E402
    PeerImportError,
    flash_ids_to_q2k,
    from_bhsd,
    import_peer,
    peer_kl_grad_rows_f64,
    peer_out_to_thd,
    peer_top_k,
    prepare_extension_build,
    proxy_tensors,
    row_agreement,
    semantic_notes,
    to_bhsd,
    write_json,
)
from msa_bench.flash_msa_peer import fmt_table as peer_table  # noqa: E402
from msa_bench.peer_steps import (  # noqa: E402
    Steps,
    add_peer_arguments,
    first_calls,
    guarded_case,
    open_peer,
    package_versions,
    time_dense,
)
from msa_bench.timing import log, peak_extra, time_fn, warm_up_gpu  # noqa: E402

PACKAGES = ("flash-msa", "nvidia-cutlass-dsl", "flash-attn-4", "quack-kernels", "apache-tvm-ffi",
            "torch", "triton", "cuda-bindings")


def environment(site_dirs) -> dict:
    """Versions and what the peer's JIT extension build needs (Python.h, nvcc, ninja)."""
    from torch.utils.cpp_extension import CUDA_HOME

    env = package_versions(site_dirs, PACKAGES)
    env["python_h"] = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    env["nvcc"] = str(Path(CUDA_HOME, "bin", "nvcc")) if CUDA_HOME else shutil.which("nvcc")
    env["ninja"] = shutil.which("ninja") or (Path(sys.executable).parent / "ninja").is_file()
    return env


def ours_fn(msa, scale, grad: bool, backend: str):
    """Our layer's attention + sparse indexer loss on a set ``s``: ``(out, loss, q2k, leaves)``;
    with ``grad`` the backward of the output (gradient ``s["do"]``) and of the loss (1) too."""
    from nemo_msa.indexer_loss import sparse_indexer_loss_from_byproducts
    from nemo_msa.ops import document_attention, select_blocks

    def run(s):
        names = ("iq", "ik", "q", "k", "v")
        x = {n: s[n].detach().requires_grad_(grad) for n in names}
        with torch.set_grad_enabled(grad):
            q2k = select_blocks(x["iq"].detach(), x["ik"].detach(), msa, top_k=TOPK,
                                score="max", backend=backend)
            out, mass = document_attention(x["q"], x["k"], x["v"], msa, softmax_scale=scale,
                                           q2k=q2k, backend=backend, return_block_mass=True)
            loss, _ = sparse_indexer_loss_from_byproducts(
                x["iq"], x["ik"], q2k, mass, msa, num_index_heads_total=HI, loss_coeff=1.0)
            if grad:
                torch.autograd.backward((out, loss), (s["do"], torch.ones_like(loss)))
        return out, loss, q2k, x

    return run


def peer_fn(fm, top_k_tokens, scale, grad: bool):
    """flash-msa on a set's converted tensors ``s["peer"]``: ``(out [B, S, H*D], leaves)``;
    with ``grad`` one backward of the output and of ``kl_loss`` (gradient 1)."""

    def run(s):
        p = s["peer"]
        x = {n: p[n].detach().requires_grad_(grad) for n in ("qp", "kp", "q", "k", "v")}
        with torch.set_grad_enabled(grad):
            out, kl = fm.flash_msa_func(x["qp"], x["kp"], x["q"], x["k"], x["v"], top_k_tokens,
                                        scale)
            if grad:
                torch.autograd.backward((out, kl), (p["do"], torch.ones_like(kl)))
        return out, x

    return run


def peer_inputs(s, batch):
    """A set's tensors in the peer's (B, H, S, D) layout (converted once, outside the timing)."""
    qp, kp = proxy_tensors(s["iq"], s["ik"], batch)
    t = s["q"].shape[0]
    return {"qp": qp, "kp": kp, "q": to_bhsd(s["q"], batch), "k": to_bhsd(s["k"], batch),
            "v": to_bhsd(s["v"], batch), "do": s["do"].reshape(batch, t // batch, -1)}


def check(r, steps, s, msa, scale, args, gen, ours_grad, flash_grad, fm):
    """The first set's checks (see the module docstring); results into ``r``."""
    from nemo_msa.testing.oracle import attention_rows_f64, rel_err, select_rows_f64

    t = msa.num_tokens
    rows = torch.randperm(t, generator=gen, device=s["q"].device)[:min(args.subset, t)]
    rows = rows.sort().values
    rows[-1] = t - 1  # the last token has the most candidates
    ref_sel = steps("f64_selection", lambda: select_rows_f64(
        s["iq"], s["ik"], msa, rows, top_k=TOPK, init_blocks=INIT, local_blocks=LOCAL,
        block_size=BS))
    ours = steps("ours_outputs", lambda: ours_grad(s))

    def ours_errors():
        out, _, q2k, x = ours
        o_ref, _, dq_ref = attention_rows_f64(s["q"], s["k"], s["v"], s["do"], q2k, msa, rows,
                                              scale, BS)
        r["ours_out_err"] = rel_err(out[rows], o_ref)
        r["ours_dq_err"] = rel_err(x["q"].grad[rows], dq_ref)
        if ref_sel is not None:
            r["ours_sel_f64_agree"] = (q2k[:, rows] == ref_sel).all(-1).float().mean().item()

    if ours is not None:
        steps("ours_check", ours_errors)
    if fm is None:
        return
    p = s["peer"]
    ids = steps("flash_selection", lambda: fm.msa_select_cutedsl.select_blocks(
        p["qp"], p["kp"], scale=scale, num_blocks=p["q"].shape[2] // BS, top_k_blocks=TOPK))
    q2k_f = None if ids is None else flash_ids_to_q2k(ids)

    def agreement():
        if ours is not None:
            r["sel_agree"] = row_agreement(q2k_f, ours[2]).float().mean().item()
        if ref_sel is not None:
            r["flash_sel_f64_agree"] = (q2k_f[:, rows] == ref_sel).all(-1).float().mean().item()

    if q2k_f is not None:
        steps("selection_agreement", agreement)
    flash = steps("flash_outputs", lambda: flash_grad(s))
    if q2k_f is None or flash is None:
        return

    def flash_errors():
        out_f = peer_out_to_thd(flash[0], HQ)
        x = flash[1]
        o_ref, _, dq_ref = attention_rows_f64(s["q"], s["k"], s["v"], s["do"], q2k_f, msa, rows,
                                              scale, BS)
        r["flash_out_err"] = rel_err(out_f[rows], o_ref)
        r["flash_dq_err"] = rel_err(from_bhsd(x["q"].grad)[rows], dq_ref)
        diq = from_bhsd(x["qp"].grad)[:, :, :DI]
        diq_ref = peer_kl_grad_rows_f64(s["iq"], s["ik"], s["q"], s["k"], q2k_f, msa, rows,
                                        scale, BS)
        r["flash_diq_err"] = rel_err(diq[rows], diq_ref)
        if ours is not None:
            agree = row_agreement(q2k_f, ours[2])  # [Hkv, T]
            mask = agree.t()[:, :, None].expand(t, HKV, HQ // HKV)  # [T, Hkv, G]
            shape = (t, HKV, HQ // HKV, D)
            if mask.any():
                r["flash_vs_ours_out"] = rel_err(out_f.reshape(shape)[mask],
                                                 ours[0].reshape(shape)[mask])

    steps("flash_check", flash_errors)


def run_case(seq_len, kind, args, gen, fm, deadline, dense_cache) -> dict:
    """Times and checks one case (``batch`` rows of one ``seq_len``-token document each)."""
    t = args.batch * seq_len
    r = {"case": f"doc{seq_len}x{args.batch}-{kind}", "tokens": t, "batch": args.batch,
         "seq_len": seq_len, "inputs": kind}
    steps = Steps(r, deadline)
    scale = 1.0 / math.sqrt(D)
    case = make_case(r["case"], [[seq_len]] * args.batch, seq_len, args.device)
    msa = case["msa"]
    sets = steps("inputs", lambda: [fresh_inputs(t, args.device, gen, kind == "coherent")
                                    for _ in range(args.sets)])
    if not sets:
        return r
    from nemo_msa.ops import select_blocks

    def ours_sel(s):
        return select_blocks(s["iq"], s["ik"], msa, top_k=TOPK, backend=args.backend)

    ours_fwd = ours_fn(msa, scale, False, args.backend)
    ours_grad = ours_fn(msa, scale, True, args.backend)
    for key, fn in (("ours_sel", ours_sel), ("ours_fwd", ours_fwd), ("ours_fwdbwd", ours_grad)):
        got = steps(key, lambda fn=fn: time_fn(fn, sets))
        r[f"{key}_ms"] = got[0] if got else None
    r["ours_fwdbwd_peak_mib"] = steps("ours_peak", lambda: peak_extra(ours_grad, sets[0]))

    flash_fwd = flash_grad = None
    if fm is not None:
        top_k_tokens = peer_top_k(TOPK, BS)
        converted = steps("flash_inputs", lambda: [s.update(peer=peer_inputs(s, args.batch))
                                                   for s in sets])
        if converted is not None:
            flash_fwd = peer_fn(fm, top_k_tokens, scale, False)
            flash_grad = peer_fn(fm, top_k_tokens, scale, True)
            r["flash_first_fwdbwd_ms"] = steps("flash_first_calls",
                                               lambda: first_calls(flash_grad, sets))
            def flash_sel(s):
                p = s["peer"]
                return fm.msa_select_cutedsl.select_blocks(p["qp"], p["kp"], scale=scale,
                                   num_blocks=p["q"].shape[2] // BS, top_k_blocks=TOPK)

            for key, fn in (("flash_sel", flash_sel), ("flash_fwd", flash_fwd),
                            ("flash_fwdbwd", flash_grad)):
                got = steps(key, lambda fn=fn: time_fn(fn, sets, warmup=1))
                r[f"{key}_ms"] = got[0] if got else None
            r["flash_fwdbwd_peak_mib"] = steps("flash_peak",
                                               lambda: peak_extra(flash_grad, sets[0]))
            bwd = sys.modules.get("flash_msa.msa_backward_cutedsl")
            r["flash_bwd_compiles"] = len(getattr(bwd, "_COMPILE_CACHE", {}))
    else:
        r["errors"]["flash"] = "skipped: flash-msa's CUDA extension did not build (see setup)"

    check(r, steps, sets[0], msa, scale, args, gen, ours_grad,
          flash_grad, fm if flash_grad is not None else None)
    sets.clear()  # frees the inputs before the dense baseline
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if seq_len not in dense_cache and not args.no_dense:
        dense = {"case": r["case"]}
        time_dense(args.batch, seq_len, gen, Steps(dense, deadline), dense)
        del dense["case"]
        r["errors"].update(dense.pop("errors"))
        dense_cache[seq_len] = dense
    r.update(dense_cache.get(seq_len, {}))
    if r.get("flash_fwdbwd_ms") and r.get("ours_fwdbwd_ms"):
        r["flash_over_ours_fwdbwd"] = r["flash_fwdbwd_ms"] / r["ours_fwdbwd_ms"]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"[peer] row {r}")
    return r


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32768,131072", help="tokens per row (one document)")
    ap.add_argument("--batch", type=int, default=1, help="rows per case")
    add_peer_arguments(ap, "a pip --target directory holding flash-msa and its dependencies "
                       "(repeatable; default: $FLASH_MSA_SITE, ':'-separated)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    fm, site_dirs = open_peer("bench_flash_msa_peer", args, "FLASH_MSA_SITE", import_peer,
                              PeerImportError, "tests/msa_kernels/test_flash_msa_peer.py")
    start = time.monotonic()
    deadline = start + args.budget_s
    payload = {"env": environment(site_dirs),
               "notes": semantic_notes(init_blocks=INIT, local_blocks=LOCAL, index_dim=DI),
               "args": vars(args), "setup": {}, "results": []}
    log(f"[peer] environment {payload['env']}")
    setup = Steps(payload["setup"], deadline)

    def save():
        if args.json:
            write_json(args.json, payload)

    def build_extension():
        from flash_msa.reverse_index_cuda import _load_ext

        payload["env"]["extension_build"] = prepare_extension_build()
        log(f"[peer] extension build settings {payload['env']['extension_build']}")
        return _load_ext() is not None

    save()  # an outer timeout during the extension's build still leaves the environment
    if not setup("flash_extension_build", build_extension):
        fm = None  # every flash step needs the extension: skip them, time ours
    setup("warm_up", warm_up_gpu)
    save()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    dense_cache = {}
    for kind in (k for k in args.inputs.split(",") if k):
        for n in (int(x) for x in args.sizes.split(",") if x):
            row = guarded_case(f"doc{n}x{args.batch}-{kind}", n * args.batch, run_case, n,
                               kind, args, gen, fm, deadline, dense_cache)
            payload["results"].append(row)
            save()
    payload["wall_s"] = time.monotonic() - start
    save()
    setup_errors = [f"setup / {k}: {v}" for k, v in payload["setup"]["errors"].items()]
    log("\n" + peer_table(payload["results"], payload["notes"] + setup_errors))


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    main()
