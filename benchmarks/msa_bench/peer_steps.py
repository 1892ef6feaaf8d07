"""What the peer benchmarks share: named steps whose failures are recorded, first-call timing,
and the cuDNN SDPA baseline."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import site
import sys
import time
import traceback
from pathlib import Path

import torch
from msa_bench.cases import HKV, HQ, D
from msa_bench.timing import log, time_fn


class Steps:
    """Runs named steps of one case: each one's exception is stored in ``r["errors"]`` (and the
    traceback logged), a step after the deadline is skipped and says so; ``tag`` prefixes the
    log lines."""

    def __init__(self, r: dict, deadline: float, tag: str = "peer"):
        self.r, self.deadline, self.tag = r, deadline, tag
        r.setdefault("errors", {})

    def __call__(self, name, fn):
        case = self.r.get("case", "setup")
        if time.monotonic() > self.deadline:
            self.r["errors"][name] = "skipped: the --budget-s time budget was spent"
            log(f"[{self.tag}] {case}: {name} skipped (time budget)")
            return None
        log(f"[{self.tag}] {case}: {name} ...")
        t0 = time.perf_counter()
        try:
            out = fn()
            sync()
        except Exception as exc:  # noqa: BLE001 - every failure is recorded, the run goes on
            text = f"{type(exc).__name__}: {exc}"
            self.r["errors"][name] = text[:4000]
            log(f"[{self.tag}] {case}: {name} FAILED after {time.perf_counter() - t0:.1f} s: "
                f"{text[:600]}")
            traceback.print_exc()
            sys.stdout.flush()
            return None
        log(f"[{self.tag}] {case}: {name} done in {time.perf_counter() - t0:.1f} s")
        return out


def first_calls(fn, sets):
    """Wall ms of the first call on each set (compiles included), in order."""
    times = []
    for s in sets:
        sync()
        t0 = time.perf_counter()
        fn(s)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def sync():
    """Waits for the GPU (nothing on a CPU-only machine: the tests' runs)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_dense(b, sl, gen, steps, r):
    """cuDNN SDPA, causal over each row, GQA: ``r["dense_fwd_ms"]``, ``r["dense_fwdbwd_ms"]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sets = [{n: torch.randn((b, h, sl, D), generator=gen, device="cuda").to(torch.bfloat16)
             for n, h in (("q", HQ), ("k", HKV), ("v", HKV), ("do", HQ))} for _ in range(2)]

    def fwdbwd(s, grad=True):
        x = {n: s[n].detach().requires_grad_(grad) for n in ("q", "k", "v")}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.set_grad_enabled(grad):
            o = torch.nn.functional.scaled_dot_product_attention(
                x["q"], x["k"], x["v"], is_causal=True, enable_gqa=True)
            if grad:
                o.backward(s["do"])

    got = steps("dense_fwd", lambda: time_fn(lambda s: fwdbwd(s, False), sets, max_reps=10,
                                             budget_ms=3000))
    r["dense_fwd_ms"] = got[0] if got else None
    got = steps("dense_fwdbwd", lambda: time_fn(fwdbwd, sets, max_reps=6, budget_ms=6000))
    r["dense_fwdbwd_ms"] = got[0] if got else None


def peer_table(results: list[dict], notes: list[str], head: str, cols: tuple[str, ...],
               fmt) -> str:
    """A peer benchmark's markdown table: ``head``, one row per result (``case``, ``tokens``,
    then ``fmt(key, value)`` for each of ``cols``, ``n/a`` where a step failed or was skipped,
    and the failed steps' names), then ``notes`` and every recorded error in full."""
    def row(r: dict) -> str:
        cells = [r.get("case", "?"), str(r.get("tokens", "?"))]
        cells += [fmt(k, r.get(k)) for k in cols]
        cells.append(", ".join(sorted(r.get("errors", {}))) or "-")
        return "| " + " | ".join(cells) + " |"

    lines = [head, "|" + "---|" * (head.count("|") - 1)] + [row(r) for r in results]
    lines += [""] + [f"- {n}" for n in notes]
    for r in results:
        for step, text in sorted(r.get("errors", {}).items()):
            lines.append(f"- error {r.get('case')} / {step}: {text}")
    return "\n".join(lines)


def add_peer_arguments(ap, site_help: str) -> None:
    """The options both peer benchmarks take (inputs, timing sets, checks, where the peer is
    installed, the time budget, the baseline, the output), added to the parser ``ap``;
    ``site_help`` says what ``--site`` directories hold."""
    ap.add_argument("--inputs", default="coherent,random",
                    help="index query kinds, in order: coherent (trained-indexer-like), random")
    ap.add_argument("--sets", type=int, default=2, help="fresh input sets rotated in timing")
    ap.add_argument("--subset", type=int, default=64, help="query rows of the float64 checks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--site", action="append", default=None, help=site_help)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="steps after this many seconds are skipped (and say so)")
    ap.add_argument("--no-dense", action="store_true", help="skip the cuDNN SDPA baseline")
    ap.add_argument("--json", default=None, help="write the results here (after every case)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the tests' CPU runs
    ap.add_argument("--backend", default="triton", help="our MSA backend")


def import_site_modules(site_dirs, modules, error) -> None:
    """Imports ``modules`` in order after adding each existing ``site_dirs`` entry with
    ``site.addsitedir`` (a ``pip install --target`` directory: its ``.pth`` files are processed
    only that way).

    Raises:
        ``error(missing, detail)`` naming the first module that cannot be imported.
    """
    for d in site_dirs:
        if Path(d).is_dir():
            site.addsitedir(str(d))
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing = getattr(exc, "name", None) or name
            raise error(missing, f"import {name}: {type(exc).__name__}: {exc}") from exc


def open_peer(script: str, args, env_var: str, import_peer, error, tests: str):
    """A peer benchmark's start: the ``--site`` directories (or ``$env_var``, ':'-separated),
    the peer imported from them, or exit status 2 with one line naming the missing module
    (``error`` raised by ``import_peer``); then a CUDA GPU, or exit naming the CPU checks
    ``tests``.

    Returns:
        ``(peer, site_dirs)``: what ``import_peer`` returned and the directories used.
    """
    site_dirs = args.site or [d for d in os.environ.get(env_var, "").split(":") if d]
    try:
        peer = import_peer(site_dirs)
    except error as exc:
        print(f"{script}: {exc}", flush=True)
        sys.exit(2)
    if not torch.cuda.is_available():
        sys.exit(f"{script}.py needs a CUDA GPU (its CPU checks: {tests})")
    return peer, site_dirs


def package_versions(site_dirs, packages) -> dict:
    """``{"site_dirs": [...], package: installed version or None, ..., "gpu": name}``."""
    env = {"site_dirs": list(site_dirs)}
    for pkg in packages:
        try:
            env[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            env[pkg] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def guarded_case(case: str, tokens: int, run, *args) -> dict:
    """``run(*args)``'s result row, or, where its setup raises, a row of ``case`` and ``tokens``
    whose ``errors`` say why (the traceback printed): a failing case ends only itself."""
    try:
        return run(*args)
    except Exception as exc:  # noqa: BLE001 - a case's setup failing ends only it
        traceback.print_exc()
        return {"case": case, "tokens": tokens,
                "errors": {"case": f"{type(exc).__name__}: {exc}"[:4000]}}
