"""Times the block-sparse attention peers beside this project's op and cuDNN on one selection.

Per case (a regime and a token count; MiniMax-M3 attention shape: 64 query / 4 KV heads,
d = 128, 128-token blocks, top-16, one document):

- the selection: fresh (the untrained indexer's random index queries), coherent (a block's
  tokens share one index query plus 5% of their own, ``layer_bench.selection.NOISE``) or trained
  (the share calibrated so that the 8-token tiles' mean union is a trained indexer's,
  ``layer_bench.selection.calibrate_trained_noise``); ``select_blocks`` once, outside the timing;
- the sides (``msa_bench.sparse_peers``): ``ours`` (``nemo_msa.sparse_attention``, Triton),
  ``fa4`` (FlashAttention-4's SM90 block-sparse attention on the 128-token tiles' unions with a
  per-token membership ``mask_mod``: MSA's function), ``fa4_union`` (the unions without the
  mask: another function, a rate bound only), ``cudnn_flex`` (cuDNN-FE's flex attention with
  an interval mask per token: MSA's function), ``cudnn_bsa`` (cuDNN-FE's block-sparse attention
  on the unions, non-causal: a bound only) and ``cudnn_dense`` (cuDNN SDPA, causal);
- before any timing, each exact peer's output and dq / dk / dv against ours on the same q, k,
  v and output gradient (relative norm error <= ``--tol``, NaN fails; a peer that fails is not
  timed), and ours against float64 on a query subset;
- forward and forward + backward: ``--warmup`` calls, then the median of ``--steps`` (CUDA
  events), fresh clones of q / k / v and a fresh output gradient per call;
- pairs: the (query, key) pairs the selection attends per query head (``pairs_msa``,
  ``layer_bench.pairs.selected_pairs``), dense causal pairs (``pairs_dense``), and for FA4 the
  pairs its union blocks make it multiply (``fa4_computed_pairs``); each side's ``pair rate``
  is its pairs per ms over cuDNN's (the bounds ``fa4_union`` and ``cudnn_bsa`` count the pairs
  of their own functions).

Every step is caught and its error stored (an out-of-memory row included) and the run goes on;
``--budget-s`` skips the steps after it; the JSON is written after every case.

Usage (on the GPU; the peers installed with pip --target, ``benchmarks/peer_wheels.sh``)::

    python benchmarks/bench_sparse_peers.py --site DIR [--tokens 8192,32768,131072]
        [--regimes fresh,coherent,trained] [--peers fa4,fa4_union,cudnn_flex,cudnn_bsa]
        [--json out.json]
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

from layer_bench.pairs import dense_pairs, selected_pairs  # noqa: E402
from layer_bench.selection import (  # noqa: E402
    NOISE,
    TRAINED_TILE,
    calibrate_trained_noise,
    coherent_index,
    mean_tile_union,
    trained_union_target,
)
from layer_bench.timing import run_timed  # noqa: E402
from msa_bench import cases  # noqa: E402
from msa_bench import sparse_formats as sf  # noqa: E402
from msa_bench import sparse_peers as sp  # noqa: E402
from msa_bench.flash_msa_peer import write_json  # noqa: E402
from msa_bench.peer_steps import Steps, guarded_case, package_versions, peer_table  # noqa: E402
from msa_bench.timing import log, warm_up_gpu  # noqa: E402

PACKAGES = ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cudnn-frontend", "quack-kernels",
            "apache-tvm-ffi", "torch", "triton")
PEERS = ("fa4", "fa4_union", "cudnn_flex", "cudnn_bsa")
REGIMES = ("fresh", "coherent", "trained")
NOTES = [
    "pair rate: the side's (query, key) pairs per ms over cuDNN dense's; ours, fa4 and "
    "cudnn_flex count the pairs MSA attends (pairs_msa), fa4_union and cudnn_bsa those of their "
    "own functions (every key of each 128-token tile's union, causal for fa4_union, not for "
    "cudnn_bsa), which are not MSA's: bounds only.",
    "fa4 computed / useful: the pairs FA4 multiplies (every row of a tile against every key of "
    "its union blocks) over those MSA attends.",
    f"peers checked against ours before timing (out, dq, dk, dv relative norm error <= tol); "
    f"FA4 {sp.FA4_VERSION}, cuDNN-FE {sp.CUDNN_FE_VERSION} (docs/adr/0056).",
]


def index_queries(regime: str, x: dict, msa, args, select) -> tuple[torch.Tensor, dict]:
    """The case's index queries for ``regime`` and what the row records about them."""
    iq = x["iq"]
    if regime == "fresh":
        return iq, {}
    if regime == "coherent":
        return coherent_index(iq, args.block, NOISE), {"noise": NOISE}
    if regime == "trained":
        target, source = trained_union_target(args.top_k, msa.num_tokens)
        found = calibrate_trained_noise(lambda c: (select(c), msa), iq, args.block, target)
        return coherent_index(iq, args.block, found["noise"]), {
            "noise": found["noise"], "trained_union": found["union"],
            "trained_union_target": target, "trained_source": source}
    raise ValueError(f"regime {regime!r}: expected one of {', '.join(REGIMES)}")


def check_side(side, x: dict, ref: dict, tol: float) -> dict:
    """``side``'s out / dq / dk / dv against ours (``ref``) on the case's inputs: the errors,
    and ``ok`` (every error finite and <= ``tol``)."""
    from nemo_msa.testing.oracle import rel_err

    leaves, douts = side.prepare(x["q"], x["k"], x["v"], x["do"])
    outs = side.forward(leaves)
    torch.autograd.backward(outs, douts)
    got = side.compact(leaves, outs)
    errors = {f"{side.name}_{n}_err": rel_err(got[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
    errors[f"{side.name}_check_ok"] = all(math.isfinite(e) and e <= tol for e in errors.values())
    return errors


def time_side(side, x: dict, args, on_gpu: bool, r: dict, steps) -> None:
    """Forward and forward + backward of ``side`` (fresh leaves and output gradient per call)
    into ``r``: ``{name}_fwd_ms``, ``{name}_fwdbwd_ms`` and their warm-up calls' ms."""
    timing = argparse.Namespace(warmup=args.warmup, steps=args.steps, max_step_s=math.inf,
                                profile=False)

    def prepare():
        return side.prepare(x["q"], x["k"], x["v"], torch.randn_like(x["do"]))

    def forward(inputs):
        side.forward(inputs[0])

    def forward_backward(inputs):
        torch.autograd.backward(side.forward(inputs[0]), inputs[1])

    for what, run in (("fwd", forward), ("fwdbwd", forward_backward)):
        scratch: dict = {}
        done = steps(f"{side.name}_{what}", lambda run=run, scratch=scratch: run_timed(
            (prepare, run), timing, on_gpu, scratch, "ms") or True)
        if done is None:
            continue
        r[f"{side.name}_{what}_ms"] = scratch.get("ms")
        r[f"{side.name}_{what}_warmup_ms"] = scratch.get("warmup_ms")


def pair_rates(r: dict, name: str, pairs: float) -> None:
    """``{name}_pair_rate_{fwd,fwdbwd}``: ``pairs`` per ms of the side over cuDNN dense's."""
    for what in ("fwd", "fwdbwd"):
        ms, dense = r.get(f"{name}_{what}_ms"), r.get(f"cudnn_dense_{what}_ms")
        if ms and dense:
            r[f"{name}_pair_rate_{what}"] = (pairs / ms) / (r["pairs_dense"] / dense)


def build_side(name: str, mods: dict, x: dict, q2k, msa, args, scale: float):
    """The peer ``name`` on the case (its conversion or plan built here)."""
    mod = mods.get(name)
    if isinstance(mod, Exception):
        raise mod
    if callable(mod):  # the tests' stand-ins: (x, q2k, msa, scale) -> Side
        return mod(x, q2k, msa, scale)
    if name in ("fa4", "fa4_union"):
        return sp.fa4_side(mod, q2k, msa, args.heads, scale, bound=name == "fa4_union")
    if name == "cudnn_flex":
        return sp.cudnn_flex_side(mod, q2k, msa, x["q"], x["k"], x["v"], scale)
    if name == "cudnn_bsa":
        return sp.cudnn_bsa_side(mod, q2k, msa, args.heads, scale)
    raise ValueError(f"peer {name!r}: expected one of {', '.join(PEERS)}")


def run_case(tokens: int, regime: str, args, mods: dict, deadline: float, dense_cache: dict,
             gen: torch.Generator) -> dict:
    """One case's selection, checks, times and pairs (see the module docstring)."""
    r = {"case": f"{regime}{tokens}", "regime": regime, "tokens": tokens}
    steps = Steps(r, deadline, tag="peers")
    on_gpu = torch.device(args.device).type == "cuda"
    scale = 1.0 / math.sqrt(args.head_dim)
    msa = cases.make_case(r["case"], [[tokens]], tokens, args.device, args.block)["msa"]
    x = cases.fresh_inputs(tokens, args.device, gen, False, args.heads, args.kv_heads,
                           args.head_dim, args.index_heads, args.head_dim)
    from nemo_msa.ops import select_blocks

    def select(index_q):
        return select_blocks(index_q, x["ik"], msa, top_k=args.top_k, backend=args.backend)

    got = steps("selection", lambda: index_queries(regime, x, msa, args, select))
    if got is None:
        return r
    iq, facts = got
    r.update(facts)
    q2k = select(iq)
    counts, _ = sf.tile_block_counts(q2k, msa, args.block)  # FA4's tile: 128 = the block
    r.update(pairs_msa=selected_pairs(q2k, msa), pairs_dense=dense_pairs([tokens]),
             union8_mean=mean_tile_union(q2k, msa, TRAINED_TILE),
             union_tile_mean=(counts > 0).sum(-1).float().mean().item())

    ours = sp.ours_side(q2k, msa, scale, args.backend)
    ref = steps("ours_outputs", lambda: _outputs(ours, x))
    if ref is None:
        return r
    f64 = steps("ours_f64", lambda: _f64_errors(x, q2k, msa, ref, scale, args, gen))
    r.update(f64 or {})
    sides = [ours]
    for name in args.peers:
        t0 = time.perf_counter()
        side = steps(f"{name}_build", lambda name=name: build_side(name, mods, x, q2k, msa,
                                                                    args, scale))
        r[f"{name}_build_s"] = time.perf_counter() - t0  # its conversion or plan, untimed
        if side is None:
            continue
        r.update({f"{name}_{k}": v for k, v in side.info.items()})
        if side.exact:
            t0 = time.perf_counter()
            errs = steps(f"{name}_check", lambda side=side: check_side(side, x, ref, args.tol))
            r[f"{name}_check_s"] = time.perf_counter() - t0  # the first calls compile here
            if errs is None:
                continue
            r.update(errs)
            if not errs[f"{name}_check_ok"]:
                r["errors"][f"{name}_check"] = (f"differs from ours beyond tol {args.tol}: "
                                                f"not timed")
                continue
        sides.append(side)
    for side in sides:
        time_side(side, x, args, on_gpu, r, steps)
        _free(on_gpu)
    ref.clear()  # frees the reference outputs before the dense baseline
    if not args.no_dense:
        if tokens not in dense_cache:
            dense = {"case": r["case"]}
            time_side(sp.dense_side(msa, scale), x, args, on_gpu, dense,
                      Steps(dense, deadline, tag="peers"))
            dense.pop("case")
            r["errors"].update(dense.pop("errors"))
            dense_cache[tokens] = dense
        r.update(dense_cache[tokens])
    for side in sides:
        pairs = r.get(f"{side.name}_bound_pairs", r["pairs_msa"])
        pair_rates(r, side.name, pairs)
    if r.get("fa4_computed_pairs"):
        r["fa4_computed_over_useful"] = r["fa4_computed_pairs"] / r["pairs_msa"]
    log(f"[peers] row {r}")
    return r


def _outputs(side, x: dict) -> dict:
    """``side``'s out and gradients on the case's inputs and output gradient."""
    leaves, douts = side.prepare(x["q"], x["k"], x["v"], x["do"])
    outs = side.forward(leaves)
    torch.autograd.backward(outs, douts)
    return side.compact(leaves, outs)


def _f64_errors(x, q2k, msa, ref, scale, args, gen) -> dict:
    """Ours against float64 on ``--subset`` query rows (the last token included)."""
    from nemo_msa.testing.oracle import attention_rows_f64, rel_err

    t = msa.num_tokens
    rows = torch.randperm(t, generator=gen, device=gen.device)[:min(args.subset, t)]
    rows = rows.sort().values.to(x["q"].device)
    rows[-1] = t - 1
    out, _, dq = attention_rows_f64(x["q"], x["k"], x["v"], x["do"], q2k, msa, rows, scale,
                                    args.block)
    return {"ours_out_err_f64": rel_err(ref["out"][rows], out),
            "ours_dq_err_f64": rel_err(ref["dq"][rows], dq)}


def _free(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.empty_cache()


def side_rows(results: list[dict], names) -> list[dict]:
    """One table row per (case, side) of the results; a key belongs to the longest side name
    it starts with (``fa4_union_*`` is not ``fa4``'s)."""
    names = sorted(names, key=len, reverse=True)

    def owner(key: str) -> str | None:
        return next((n for n in names if key.startswith(f"{n}_") or key == n), None)

    out = []
    for r in results:
        for name in sorted(names, key=list(names).index):
            own = {k[len(name) + 1:]: v for k, v in r.items() if owner(k) == name}
            errors = {k: v for k, v in r.get("errors", {}).items() if owner(k) == name
                      or (name == "ours" and owner(k) is None)}
            if not own and not errors:
                continue
            errs = [own.get(f"{n}_err") for n in ("out", "dq", "dk", "dv")]
            errs = [e for e in errs if isinstance(e, float)]
            out.append({**own, "case": f"{r.get('case')} {name}", "tokens": r.get("tokens"),
                        "errors": errors, "union8": r.get("union8_mean"),
                        "check_err": max(errs) if errs else None})
    return out


def fmt_table(results: list[dict], notes: list[str],
              names=("ours", *PEERS, "cudnn_dense")) -> str:
    """The markdown table of the results (one row per case and side of ``names``) and the
    notes."""
    head = ("| case | tokens | fwd ms | f+b ms | pair rate fwd | pair rate f+b | max check err "
            "| union8 | failed steps |")
    cols = ("fwd_ms", "fwdbwd_ms", "pair_rate_fwd", "pair_rate_fwdbwd", "check_err", "union8")

    def fmt(key, value):
        if not isinstance(value, float | int):
            return "n/a"
        if key == "check_err":
            return f"{value:.1e}"
        return f"{value:.1f}" if key.endswith("_ms") else f"{value:.2f}"

    return peer_table(side_rows(results, names), notes, head, cols, fmt)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192,32768,131072", help="tokens per case (one doc)")
    ap.add_argument("--regimes", default=",".join(REGIMES), help="selection regimes, in order")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="peers to run, comma-separated ('none': ours and cuDNN dense only)")
    ap.add_argument("--site", action="append", default=None,
                    help="a pip --target directory holding the peers (repeatable; default "
                    "$SPARSE_PEERS_SITE, ':'-separated)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="steps after this many seconds are skipped (and say so)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per side and pass")
    ap.add_argument("--steps", type=int, default=5, help="timed calls per side and pass")
    ap.add_argument("--tol", type=float, default=1e-2, help="check tolerance against ours")
    ap.add_argument("--subset", type=int, default=64, help="query rows of the float64 check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-dense", action="store_true", help="skip the cuDNN dense baseline")
    ap.add_argument("--json", default=None, help="write the results here (after every case)")
    ap.add_argument("--backend", default="triton", help="our MSA backend")
    # The tests' CPU runs: small shapes on the reference backend.
    for flag, default in (("--heads", cases.HQ), ("--kv-heads", cases.HKV),
                          ("--head-dim", cases.D), ("--index-heads", cases.HI),
                          ("--block", cases.BS), ("--top-k", cases.TOPK)):
        ap.add_argument(flag, type=int, default=default, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return ap


def parse(argv=None):
    """The parsed arguments, with the lists split."""
    args = build_parser().parse_args(argv)
    args.tokens = [int(x) for x in args.tokens.split(",") if x]
    args.regimes = [x for x in args.regimes.split(",") if x]
    args.peers = [x for x in args.peers.split(",") if x and x != "none"]
    for name in args.peers:
        if name not in PEERS:
            raise SystemExit(f"--peers {name!r}: expected names from {', '.join(PEERS)}")
    for name in args.regimes:
        if name not in REGIMES:
            raise SystemExit(f"--regimes {name!r}: expected names from {', '.join(REGIMES)}")
    return args


def run(args, mods: dict, site_dirs) -> dict:
    """Every case in turn (regimes outer, tokens inner); the payload (also written to
    ``--json`` after every case)."""
    start = time.monotonic()
    deadline = start + args.budget_s
    payload = {"env": package_versions(site_dirs, PACKAGES), "notes": NOTES,
               "args": vars(args), "setup": {}, "results": [],
               "peer_import_errors": {k: str(v) for k, v in mods.items()
                                      if isinstance(v, Exception)}}
    log(f"[peers] environment {payload['env']}")
    if torch.device(args.device).type == "cuda":
        Steps(payload["setup"], deadline, tag="peers")("warm_up", warm_up_gpu)

    def save():
        if args.json:
            write_json(args.json, payload)

    save()
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    dense_cache: dict = {}
    for regime in args.regimes:
        for tokens in args.tokens:
            payload["results"].append(guarded_case(
                f"{regime}{tokens}", tokens, run_case, tokens, regime, args, mods, deadline,
                dense_cache, gen))
            save()
            _free(torch.device(args.device).type == "cuda")
    payload["wall_s"] = time.monotonic() - start
    save()
    return payload


def main(argv=None):
    args = parse(argv)
    site_dirs = args.site or [d for d in os.environ.get("SPARSE_PEERS_SITE", "").split(":") if d]
    mods = sp.import_peers(args.peers, site_dirs)
    for name, mod in mods.items():
        if isinstance(mod, Exception):
            log(f"[peers] {name}: {mod}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_sparse_peers.py needs a CUDA GPU (its CPU checks: "
                 "tests/msa_kernels/test_sparse_peers.py)")
    payload = run(args, mods, site_dirs)
    errors = [f"setup / {k}: {v}" for k, v in payload["setup"].get("errors", {}).items()]
    errors += [f"import / {k}: {v}" for k, v in payload["peer_import_errors"].items()]
    log("\n" + fmt_table(payload["results"], payload["notes"] + errors,
                          ("ours", *args.peers, "cudnn_dense")))


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    main()
