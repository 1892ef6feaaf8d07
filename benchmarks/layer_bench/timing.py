"""Timing of a row: wall time (CUDA events or perf_counter), peak memory, the out-of-memory
check, the profiler's top kernels, and the warm-up / timed-steps loop that fills a row."""

from __future__ import annotations

import contextlib
import cProfile
import gc
import os
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile


class Timer:
    """Wall time of a region: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, on_gpu: bool) -> None:
        """Times on the GPU (CUDA events) when ``on_gpu``, on the host otherwise."""
        self.on_gpu = on_gpu

    @contextlib.contextmanager
    def region(self, out: list[float]):
        """Appends the region's time in ms to ``out`` when the region ends."""
        if self.on_gpu:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            yield
            out.append((time.perf_counter() - t0) * 1e3)


def peak_gib(on_gpu: bool) -> float | None:
    """Peak allocated GiB since the last :func:`reset_peak` (None on the CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None


def reset_peak(on_gpu: bool) -> None:
    """Starts a new peak-memory window (after the queued work ends) on the GPU."""
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def free_memory(on_gpu: bool) -> None:
    """Collects garbage and, on the GPU, returns cached blocks, so the next row starts clean."""
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error (CUDA's, or any whose text says so)."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def profile_top(fn, on_gpu: bool, top: int, trace: str | None = None) -> list[dict]:
    """The ``top`` kernels of one call of ``fn`` by device time (CPU ops by CPU time on CPU).

    Args:
        trace: where to write the call's Chrome trace (host ops and kernels, so a kernel can be
            traced back to the op and module that launched it); None writes none.

    Returns:
        ``[{"name", "ms", "calls"}]``, largest first.
    """
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    if trace is not None and on_gpu:
        activities.append(ProfilerActivity.CPU)
    with profile(activities=activities) as prof:
        fn()
        if on_gpu:
            torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(trace)
    events = list(prof.key_averages())
    if on_gpu:
        kernels = [e for e in events
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        # Where the averages do not keep the device type, the ops' self device time is the
        # time of the kernels they launched.
        events = kernels or events
    rows = []
    for event in events:
        us = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if us > 0:
            rows.append({"name": event.key[:90], "ms": us / 1e3, "calls": event.count})
    rows.sort(key=lambda row: -row["ms"])
    return rows[:top]


def host_profile(fn, on_gpu: bool, top: int) -> tuple[float, list[dict]]:
    """The host side of one call of ``fn``: how long issuing it takes, and where that goes.

    Issuing is timed without the profiler, from a synchronized start to ``fn``'s return
    (before the device finishes), so it is the time the host needs to queue the step; when it
    is close to the step time, the step is host-bound. A second call runs under cProfile,
    which slows Python down: its function times rank the host work, they do not measure it.

    Returns:
        ``(issue_ms, functions)``: ``functions`` holds ``top`` rows ``{"function", "self_ms",
        "total_ms", "calls"}`` by self time.
    """
    if on_gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    issue_ms = (time.perf_counter() - t0) * 1e3
    if on_gpu:
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    if on_gpu:
        torch.cuda.synchronize()
    prof.disable()
    rows = []
    for (path, line, name), (_, calls, self_s, total_s, _) in pstats.Stats(prof).stats.items():
        rows.append({"function": f"{os.path.basename(path)}:{line}({name})",
                     "self_ms": self_s * 1e3, "total_ms": total_s * 1e3, "calls": calls})
    rows.sort(key=lambda row: -row["self_ms"])
    return issue_ms, rows[:top]


def run_row(bench, args, on_gpu: bool, row: dict, key: str) -> bool:
    """:func:`run_timed`, with a failure recorded in ``row`` instead of raised (``status``
    ``oom`` or ``error`` and a ``note``) and the memory freed, so the run goes on.

    Returns:
        True when the row failed.
    """
    try:
        run_timed(bench, args, on_gpu, row, key)
        return False
    except Exception as error:  # OOM is reported; anything else too, and the run goes on
        row.update(status="oom" if is_oom(error) else "error",
                   note=f"{type(error).__name__}: {str(error)[:300]}")
        free_memory(on_gpu)
        return True


def run_timed(bench, args, on_gpu: bool, row: dict, key: str) -> None:
    """Warm-up, the too-slow check, timed steps (median), peak memory and the optional profile.

    Fills ``row`` in place: ``status`` and ``key`` (ms), ``peak_gib``, ``warmup_ms``,
    ``kernels``. ``bench`` is ``(prepare, run)``: ``prepare()`` makes fresh random inputs
    (untimed), ``run(inputs)`` is the timed work.
    """
    prepare, run = bench
    timer = Timer(on_gpu)
    reset_peak(on_gpu)
    warm: list[float] = []
    warmups = max(1, args.warmup)
    for i in range(warmups):
        inputs = prepare()
        with timer.region(warm):
            run(inputs)
        del inputs
        row["warmup_ms"] = [round(t, 3) for t in warm]
        # The first step compiles every kernel the row launches (32.6 s at 8192 tokens on a cold
        # Triton cache on the H100), so it decides only where it is the only warm-up step; after
        # it, one slow step is all a too-slow row costs.
        if (i > 0 or warmups == 1) and warm[-1] > args.max_step_s * 1e3:
            row.update(status="too_slow", peak_gib=peak_gib(on_gpu))
            row["note"] = f"a warm-up step took {warm[-1] / 1e3:.1f} s > --max-step-s"
            return
    times: list[float] = []
    for _ in range(args.steps):
        inputs = prepare()
        with timer.region(times):
            run(inputs)
        del inputs
    row[key] = statistics.median(times)
    row["peak_gib"] = peak_gib(on_gpu)
    row["status"] = "ok"
    if args.profile:
        inputs = prepare()
        trace = None
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            # Packed and one-document rows of the same length need their own files.
            packed = f"_mean{row['doc_mean']}" if row.get("doc_mean") else ""
            trace = os.path.join(args.trace, f"{row['case']}_{row['tokens']}{packed}.json")
        row["kernels"] = profile_top(lambda: run(inputs), on_gpu, args.profile_top, trace)
    if getattr(args, "host_profile", False):
        inputs = prepare()
        row["host_issue_ms"], row["host_functions"] = host_profile(lambda: run(inputs), on_gpu,
                                                                   args.profile_top)

