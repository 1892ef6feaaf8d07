"""benchmarks/layer_bench/trace_attribution.py on synthetic Chrome traces: kernels land on the host
op (or backward node) that launched them, the GPU's idle gaps on the kernel that ends each, and
``--against`` subtracts the dense step's trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from layer_bench.trace_attribution import (
    attribute,
    difference,
    gpu_span,
    summarize,
    waits,
)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)


def _trace(kernels: list[tuple[str, str, float, float]]) -> dict:
    """A trace of (host op, kernel name, start us, duration us): each kernel's launch sits
    inside its host op on one thread, linked by a correlation id."""
    events = []
    for i, (op, name, ts, dur) in enumerate(kernels):
        events.append({"cat": "cpu_op", "name": op, "ts": ts - 5.0, "dur": 4.0, "tid": 1})
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts - 3.0,
                       "dur": 1.0, "tid": 1, "args": {"correlation": i}})
        events.append({"cat": "kernel", "name": name, "ts": ts, "dur": dur,
                       "args": {"correlation": i}})
    return {"traceEvents": events}


DENSE = _trace([
    ("aten::mm", "nvjet_gemm_a", 100.0, 50.0),
    ("aten::add", "elementwise_add", 200.0, 10.0),
    ("autograd::engine::evaluate_function: SiluBackward0", "silu_backward_kernel", 300.0, 20.0),
])
MSA = _trace([
    ("aten::mm", "nvjet_gemm_a", 100.0, 50.0),
    ("aten::add", "elementwise_add", 200.0, 30.0),
    ("autograd::engine::evaluate_function: SiluBackward0", "silu_backward_kernel", 300.0, 20.0),
    ("_SparseAttention", "_fwd_kernel", 400.0, 70.0),
])


def test_attribute_groups_by_kind_and_launching_op():
    busy, time, count = attribute(MSA)
    assert busy == 170.0
    assert time[("GEMM", "aten::mm")] == 50.0
    assert time[("TRITON:_fwd_kernel", "_SparseAttention")] == 70.0
    assert time[("small", "SiluBackward0 > autograd::engine::evaluate_function: SiluBackward0")] \
        == 20.0
    assert sum(count.values()) == 4
    assert gpu_span(MSA) == 370.0 and gpu_span({"traceEvents": []}) == 0.0


def test_difference_is_msa_minus_dense_by_site():
    diff = difference(summarize(MSA), summarize(DENSE))
    assert diff["busy"] == 90.0 and diff["span"] == 150.0 and diff["idle"] == 60.0
    assert diff["kinds"]["TRITON"] == 70.0 and diff["kinds"]["GEMM"] == 0.0
    assert diff["kinds"]["small"] == 20.0
    assert diff["groups"][("small", "aten::add > aten::add")] == 20.0
    assert diff["groups"][("TRITON:_fwd_kernel", "_SparseAttention")] == 70.0
    # A site only the base has counts negative.
    back = difference(summarize(DENSE), summarize(MSA))
    assert back["groups"][("TRITON:_fwd_kernel", "_SparseAttention")] == -70.0


def test_waits_charge_each_gap_to_the_kernel_that_ends_it():
    wait = waits(MSA)
    add = ("small", "aten::add > aten::add")
    silu = ("small", "SiluBackward0 > autograd::engine::evaluate_function: SiluBackward0")
    fwd = ("TRITON:_fwd_kernel", "_SparseAttention")
    assert wait == {add: 50.0, silu: 70.0, fwd: 80.0}
    # The first kernel waits for nothing, and the waits add up to the idle time.
    assert ("GEMM", "aten::mm") not in wait
    assert sum(wait.values()) == summarize(MSA)["idle"] == 200.0
    diff = difference(summarize(MSA), summarize(DENSE))
    assert diff["waits"][fwd] == 80.0 and diff["waits"][silu] == -20.0
    assert diff["waits"][add] == 0.0


def test_waits_count_no_gap_under_an_overlapping_kernel():
    # The second kernel starts before the first ends and ends after the third starts: no gap
    # until the fourth, which waits from the latest end (300), not from the third's (230).
    trace = _trace([
        ("aten::mm", "nvjet_gemm_a", 100.0, 200.0),
        ("aten::add", "elementwise_add", 150.0, 50.0),
        ("aten::mul", "elementwise_mul", 210.0, 20.0),
        ("_Rope", "_rope_kernel", 340.0, 10.0),
    ])
    assert waits(trace) == {("TRITON:_rope_kernel", "_Rope"): 40.0}


def test_cli_prints_the_difference(tmp_path):
    (tmp_path / "dense.json").write_text(json.dumps(DENSE))
    (tmp_path / "msa.json").write_text(json.dumps(MSA))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "layer_bench" / "trace_attribution.py"),
         str(tmp_path / "msa.json"), "--against", str(tmp_path / "dense.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "idle 0.2 ms" in proc.stdout
    assert "span +0.1 ms, busy +0.1 ms, idle +0.1 ms" in proc.stdout
    assert "+0.070 ms  TRITON:_fwd_kernel" in proc.stdout
    assert "GPU idle before the kernels of (ms):" in proc.stdout
    assert "0.080 ms  TRITON:_fwd_kernel" in proc.stdout
    assert "GPU idle before the kernels of, minus the base's (ms):" in proc.stdout
