"""Times fla-core's NSA selected-block attention beside our Triton MSA attention, same q2k.

Per case (MiniMax-M3 attention shape: 64 query / 4 KV heads, d = 128, 128-token blocks, top-16
blocks; index queries coherent or random, see bench_msa.py; one document of N tokens, or N
tokens of packed documents of 1024..16384 tokens in rows of 16384):

- the selection: our ``select_blocks`` once per input set, before any timing (its time is
  reported on its own as ``ours_sel_ms``); both sides then attend over exactly these blocks;
- ours: ``triton_attention_forward``, and forward + ``triton_attention_backward`` (the
  forward's union lists passed on, as the op does);
- fla: ``ParallelNSAFunction`` through :func:`msa_bench.fla_nsa_peer.fla_attention` (q2k
  converted to its block_indices and the documents to its cu_seqlens once per set, outside the
  timing), forward under no_grad, and forward + backward by autograd; its first forward +
  backward (Triton autotuning included) timed apart;
- cuDNN SDPA, causal over each padded row, GQA: the common baseline;
- checks on the first input set: each side's output and dq against float64 on a query subset
  (``attention_rows_f64`` with the same q2k), and fla's dq / dk / dv against ours.

Every step is caught and its error stored in the JSON and the table; the JSON is written after
every case. Semantics: benchmarks/msa_bench/fla_nsa_peer.py, docs/adr/0029-flash-msa-peer.md.

Usage (on the GPU; fla-core and einops installed with ``pip install --target DIR``)::

    python benchmarks/bench_fla_nsa_peer.py --site DIR [--sizes 8192,32768,131072]
        [--layouts one,packed] [--inputs coherent,random] [--json fla.json]

Exit status 2, with one line naming the missing module, where fla-core cannot be imported.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from msa_bench.cases import BS, HKV, TOPK, D, fresh_inputs, make_case, packed_rows  # noqa: E402
from msa_bench.fla_nsa_peer import (  # noqa: E402
    NOTES,
    PeerImportError,
    fla_attention,
    fla_inputs,
    fmt_table,
    import_peer,
)
from msa_bench.flash_msa_peer import write_json  # noqa: E402
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

PACKAGES = ("fla-core", "einops", "torch", "triton")
#: Packed cases: documents of 1024..16384 tokens in rows of 16384 (bench_msa.py's mix).
PACK_LO, PACK_ROW = 1024, 16384


def environment(site_dirs) -> dict:
    """The installed versions of :data:`PACKAGES` and the GPU."""
    return package_versions(site_dirs, PACKAGES)


def ours_fn(msa, scale, grad: bool, backend: str):
    """Our attention on a set ``s`` with its q2k ``s["q2k"]``: ``(out, leaves)``; with ``grad``
    the backward of ``s["do"]`` too, its gradients in ``leaves`` (``{"dq", "dk", "dv"}``)."""
    if backend == "triton":
        from nemo_msa.attention.triton_bwd import triton_attention_backward as bwd
        from nemo_msa.attention.triton_fwd import triton_attention_forward as fwd
    else:  # the tests' CPU runs: the plain-PyTorch reference, same signature but the unions
        from nemo_msa.attention.naive import sparse_attention_backward_reference as bwd
        from nemo_msa.attention.naive import sparse_attention_forward_reference as fwd

    def run(s):
        q, k, v, q2k = s["q"], s["k"], s["v"], s["q2k"]
        if not grad:
            return fwd(q, k, v, q2k, msa, scale)[0], {}
        if backend == "triton":
            out, lse, unions = fwd(q, k, v, q2k, msa, scale, return_unions=True)
            dq, dk, dv = bwd(s["do"], q, k, v, out, lse, q2k, msa, scale, unions=unions)
        else:
            out, lse = fwd(q, k, v, q2k, msa, scale)
            dq, dk, dv = bwd(s["do"], q, k, v, out, lse, q2k, msa, scale)
        return out, {"dq": dq, "dk": dk, "dv": dv}

    return run


def peer_fn(fla, scale, grad: bool):
    """fla on a set's tensors and converted selection ``s["fla"]``: ``(out, leaves)``; with
    ``grad`` one autograd backward of ``s["do"]``, the gradients in ``leaves``."""

    def run(s):
        x = {n: s[n].detach().requires_grad_(grad) for n in ("q", "k", "v")}
        with torch.set_grad_enabled(grad):
            out = fla_attention(fla, x["q"], x["k"], x["v"], s["fla"], scale)
            if grad:
                out.backward(s["do"])
        return out, {f"d{n}": x[n].grad for n in x} if grad else {}

    return run


def check(r, steps, s, msa, scale, args, gen, ours_grad, fla_grad):
    """The first set's checks (see the module docstring); results into ``r``."""
    from nemo_msa.testing.oracle import attention_rows_f64, rel_err

    t = msa.num_tokens
    rows = torch.randperm(t, generator=gen, device=s["q"].device)[:min(args.subset, t)]
    rows = rows.sort().values
    rows[-1] = t - 1  # the last token sees the most blocks
    ref = steps("f64_reference", lambda: attention_rows_f64(
        s["q"], s["k"], s["v"], s["do"], s["q2k"], msa, rows, scale, BS))
    if ref is None:
        return
    o_ref, _, dq_ref = ref
    ours = steps("ours_outputs", lambda: ours_grad(s))
    if ours is not None:
        r["ours_out_err"] = rel_err(ours[0][rows], o_ref)
        r["ours_dq_err"] = rel_err(ours[1]["dq"][rows], dq_ref)
    fla = None if fla_grad is None else steps("fla_outputs", lambda: fla_grad(s))
    if fla is None:
        return
    r["fla_out_err"] = rel_err(fla[0][rows], o_ref)
    r["fla_dq_err"] = rel_err(fla[1]["dq"][rows], dq_ref)
    if ours is not None:
        r["fla_vs_ours_out"] = rel_err(fla[0], ours[0])
        for n in ("dq", "dk", "dv"):
            r[f"fla_vs_ours_{n}"] = rel_err(fla[1][n], ours[1][n])


def make_layout(n, layout, args, host_gen):
    """``(name, rows, seq_len)`` of a case: one n-token document, or n tokens of packed ones."""
    if layout == "one":
        return f"doc{n}", [[n]], n
    if layout == "packed":
        row = min(PACK_ROW, n)
        return f"packed{n}", packed_rows(n, min(PACK_LO, row), row, row, host_gen), row
    raise ValueError(f"layout {layout!r}: expected one or packed")


def run_case(n, layout, kind, args, gen, fla, deadline, dense_cache, host_gen) -> dict:
    """Times and checks one case (see the module docstring)."""
    name, rows, seq_len = make_layout(n, layout, args, host_gen)
    r = {"case": f"{name}-{kind}", "layout": layout, "inputs": kind, "seq_len": seq_len,
         "rows": len(rows), "docs": sum(len(x) for x in rows)}
    steps = Steps(r, deadline, tag="fla")
    scale = 1.0 / math.sqrt(D)
    msa = make_case(name, rows, seq_len, args.device)["msa"]
    t = r["tokens"] = msa.num_tokens
    from nemo_msa.ops import select_blocks

    def sel(s):
        return select_blocks(s["iq"], s["ik"], msa, top_k=TOPK, backend=args.backend)

    def make_sets():
        sets = [fresh_inputs(t, args.device, gen, kind == "coherent") for _ in range(args.sets)]
        for s in sets:
            s["q2k"] = sel(s)
        return sets

    sets = steps("inputs", make_sets)
    if not sets:
        return r
    assert sets[0]["q2k"].shape == (HKV, t, TOPK)
    got = steps("ours_sel", lambda: time_fn(sel, sets))
    r["ours_sel_ms"] = got[0] if got else None
    ours_fwd = ours_fn(msa, scale, False, args.backend)
    ours_grad = ours_fn(msa, scale, True, args.backend)
    for key, fn in (("ours_fwd", ours_fwd), ("ours_fwdbwd", ours_grad)):
        got = steps(key, lambda fn=fn: time_fn(fn, sets))
        r[f"{key}_ms"] = got[0] if got else None
    r["ours_fwdbwd_peak_mib"] = steps("ours_peak", lambda: peak_extra(ours_grad, sets[0]))

    fla_grad = None
    if fla is not None and steps("fla_inputs", lambda: [s.update(fla=fla_inputs(
            s["q2k"], msa, BS)) for s in sets]) is not None:
        got = steps("fla_convert", lambda: time_fn(
            lambda s: fla_inputs(s["q2k"], msa, BS, check=False), sets))
        r["fla_convert_ms"] = got[0] if got else None
        fla_fwd, fla_grad = peer_fn(fla, scale, False), peer_fn(fla, scale, True)
        first = steps("fla_first_calls", lambda: first_calls(fla_grad, sets[:1]))
        r["fla_first_fwdbwd_ms"] = first[0] if first else None
        for key, fn in (("fla_fwd", fla_fwd), ("fla_fwdbwd", fla_grad)):
            got = steps(key, lambda fn=fn: time_fn(fn, sets))
            r[f"{key}_ms"] = got[0] if got else None
        r["fla_fwdbwd_peak_mib"] = steps("fla_peak", lambda: peak_extra(fla_grad, sets[0]))

    check(r, steps, sets[0], msa, scale, args, gen, ours_grad, fla_grad)
    sets.clear()  # frees the inputs before the dense baseline
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    key = (len(rows), seq_len)
    if key not in dense_cache and not args.no_dense:
        dense = {"case": r["case"]}
        time_dense(len(rows), seq_len, gen, Steps(dense, deadline, tag="fla"), dense)
        del dense["case"]
        r["errors"].update(dense.pop("errors"))
        dense_cache[key] = dense
    r.update(dense_cache.get(key, {}))
    for what in ("fwd", "fwdbwd"):
        if r.get(f"fla_{what}_ms") and r.get(f"ours_{what}_ms"):
            r[f"fla_over_ours_{what}"] = r[f"fla_{what}_ms"] / r[f"ours_{what}_ms"]
    log(f"[fla] row {r}")
    return r


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8192,32768,131072", help="tokens per case")
    ap.add_argument("--layouts", default="one,packed",
                    help="one (one document) and/or packed (documents of 1024..16384 tokens)")
    add_peer_arguments(ap, "a pip --target directory holding fla-core and einops (repeatable; "
                       "default: $FLA_SITE, ':'-separated)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    fla, site_dirs = open_peer("bench_fla_nsa_peer", args, "FLA_SITE", import_peer,
                               PeerImportError, "tests/msa_kernels/test_fla_nsa_peer.py")
    start = time.monotonic()
    deadline = start + args.budget_s
    payload = {"env": environment(site_dirs), "notes": NOTES, "args": vars(args), "setup": {},
               "results": []}
    log(f"[fla] environment {payload['env']}")
    Steps(payload["setup"], deadline, tag="fla")("warm_up", warm_up_gpu)

    def save():
        if args.json:
            write_json(args.json, payload)

    save()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    host_gen = torch.Generator().manual_seed(args.seed)
    dense_cache = {}
    for kind in (k for k in args.inputs.split(",") if k):
        for layout in (x for x in args.layouts.split(",") if x):
            for n in (int(x) for x in args.sizes.split(",") if x):
                row = guarded_case(f"{layout}{n}-{kind}", n, run_case, n, layout, kind, args,
                                   gen, fla, deadline, dense_cache, host_gen)
                payload["results"].append(row)
                save()
    payload["wall_s"] = time.monotonic() - start
    save()
    setup_errors = [f"setup / {k}: {v}" for k, v in payload["setup"]["errors"].items()]
    log("\n" + fmt_table(payload["results"], payload["notes"] + setup_errors))


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    main()
