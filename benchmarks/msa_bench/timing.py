"""Timing and memory on the GPU: CUDA-event medians, peak extra allocation, the profiler."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch


def log(*a):
    print(*a, flush=True)


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Busy bf16 matmuls for ``seconds`` before the first timing, so that the first case is
    not measured while clocks ramp up."""
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def time_fn(fn, input_sets, min_reps=3, max_reps=40, budget_ms=1500.0, warmup=2):
    """Median ms of ``fn(inputs)`` over rotating input sets, CUDA events around each call;
    returns ``(median ms, repetitions)``."""
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
    """MiB allocated at the peak of ``fn(inputs)`` beyond what was allocated before and its
    ``out_bytes`` of outputs."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = fn(inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - out_bytes
    del res
    return peak / 2**20


@contextlib.contextmanager
def deterministic_mode():
    """torch.use_deterministic_algorithms(True) for the block (the backward's path there)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


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
    log(f"kernel profile of MSA fwd+bwd, {name}, {reps} calls (times are totals over them):")
    log(prof.key_averages().table(sort_by="self_device_time_total", row_limit=16,
                                  max_name_column_width=60))
