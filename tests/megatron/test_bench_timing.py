"""benchmarks/layer_bench/timing.py's too-slow check: the first warm-up step, which compiles the
row's kernels, decides only where it is the only one; a later slow warm-up step stops the row."""

from __future__ import annotations

import time
from argparse import Namespace

import pytest
from layer_bench.timing import run_timed

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

SLOW_S = 0.3
LIMIT_S = 0.15  # half the slow step; a fast step takes microseconds


def _bench(slow_steps: set[int]):
    """A bench whose run sleeps SLOW_S on the given (0-based) calls, and the list of calls."""
    calls: list[int] = []

    def run(inputs):
        calls.append(inputs)
        if inputs in slow_steps:
            time.sleep(SLOW_S)

    return (lambda: len(calls), run), calls


def _run(slow_steps: set[int], warmup: int, steps: int = 2) -> tuple[dict, list[int]]:
    bench, calls = _bench(slow_steps)
    row: dict = {}
    args = Namespace(warmup=warmup, steps=steps, max_step_s=LIMIT_S, profile=False,
                     host_profile=False, trace=None)
    run_timed(bench, args, False, row, "step_ms")
    return row, calls


def test_a_slow_first_warmup_step_is_compilation_and_the_row_is_timed():
    row, calls = _run({0}, warmup=2)
    assert row["status"] == "ok", row
    assert calls == [0, 1, 2, 3]  # two warm-up steps, two timed
    assert row["warmup_ms"][0] > LIMIT_S * 1e3 and row["step_ms"] < LIMIT_S * 1e3


def test_a_slow_later_warmup_step_stops_the_row_there():
    row, calls = _run({0, 1, 2}, warmup=3)
    assert row["status"] == "too_slow" and "--max-step-s" in row["note"], row
    assert calls == [0, 1]  # stopped after the second warm-up step: no third, no timed steps
    assert "step_ms" not in row


def test_the_only_warmup_step_decides():
    row, calls = _run({0}, warmup=1)
    assert row["status"] == "too_slow", row
    assert calls == [0] and "step_ms" not in row
