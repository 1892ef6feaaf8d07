"""What the peer benchmarks share: named steps whose failures are recorded, first-call timing,
and the cuDNN SDPA baseline."""

from __future__ import annotations

import sys
import time
import traceback

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
