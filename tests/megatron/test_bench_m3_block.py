"""benchmarks/bench_layer.py --m3-block on the CPU (--tiny): the real M3 block (one MoE layer with
SwiGLU-OAI and Gemma norms) is timed for dense attention and MSA, and the JSON says which block."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    # The M3 block's first step compiles Megatron's torch.compile'd MoE functions with inductor
    # on the CPU (about 15 s alone, twice that with both cores busy), past bench_layer.py's
    # default --max-step-s of 30 s, which would report the dense row too_slow: these tests check
    # the rows, not the speed.
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_layer.py"), "--tiny", "--cpu",
           "--m3-block", "--steps", "1", "--warmup", "1", "--max-step-s", "600",
           "--json", str(tmp_path / "m3.json"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=tmp_path,
                          env={**os.environ, "NEMO_MSA_COMMIT": "test-commit"})


def test_m3_block_rows_dense_vs_msa(tmp_path):
    proc = _run(tmp_path, "--tokens", "64", "--no-attention-rows")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "m3.json").read_text())
    assert result["m3_block"] == {"experts": 4, "topk": 2, "expert_ffn": 64, "shared_ffn": 64}
    assert [row["case"] for row in result["rows"]] == ["dense", "msa_loss_off",
                                                      "msa_sparse_loss"]
    for row in result["rows"]:
        assert row["status"] == "ok", row
        assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0, row
    assert "msa_sparse_loss: MSASelfAttention, MoELayer" in proc.stdout + proc.stderr


def test_experts_needs_the_block_and_enough_experts(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_layer.py"), "--tiny",
                           "--cpu", "--experts", "8"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode != 0 and "--experts needs --m3-block" in proc.stderr
    proc = _run(tmp_path, "--experts", "1")
    assert proc.returncode != 0 and "--experts=1: expected >= the top-k 2" in proc.stderr


def test_the_m3_block_runs_te_grouped_gemm_with_the_te_spec():
    """With the TE spec the experts are TE's grouped GEMM, as recipes/minimax_m3_msa.yaml trains
    them (a SequentialMLP would time one GEMM per expert); the local spec keeps SequentialMLP."""
    from layer_bench.model import M3_BLOCK, block_fields

    assert block_fields(M3_BLOCK, True, "transformer_engine")["moe_grouped_gemm"] is True
    assert block_fields(M3_BLOCK, True, "local")["moe_grouped_gemm"] is False
