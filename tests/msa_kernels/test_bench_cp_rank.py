"""benchmarks/bench_cp_rank.py end to end on the CPU (--tiny, Triton interpreter): the single-GPU
row and one CP pair's most- and least-loaded ranks are measured and land in the JSON with
cp_size / cp_rank, positive finite times and the per-pair summary; a spent time budget skips
rows; bad pairs fail before anything runs. In a subprocess (the script decides interpretation
before importing the kernels)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

ROOT = Path(__file__).resolve().parents[2]
#: Compiled where CUDA exists (the device image's numpy does not run Triton 3.6's interpreter).
ON_GPU = torch.cuda.is_available()


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_cp_rank.py"), "--tiny",
           *([] if ON_GPU else ["--cpu"]),
           "--steps", "1", "--warmup", "1", "--json", str(tmp_path / "cp.json"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=tmp_path,
                          env={**os.environ, "NEMO_MSA_COMMIT": "test-commit"})


def test_tiny_run_reports_the_baseline_and_both_extreme_ranks(tmp_path):
    # Two documents of 40 and 24 tokens over 64: chunks of 16 (CP=2), the second document
    # straddles the middle; the ranks' loads differ, so extremes are ranks 0 and 1.
    proc = _run(tmp_path, "--cp", "64:2", "--baseline", "32", "--doc-tokens", "40")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "cp.json").read_text())
    assert result["commit"] == "test-commit"
    assert (result["gpu"] == "cpu") != ON_GPU
    rows = {(r["tokens"], r["cp_size"], r["cp_rank"]): r for r in result["rows"]}
    assert set(rows) == {(32, 1, 0), (64, 2, 0), (64, 2, 1)}
    for (tokens, cp, _), row in rows.items():
        assert row["status"] == "ok", row
        assert row["local_tokens"] == tokens // cp
        assert isinstance(row["step_ms"], float) and math.isfinite(row["step_ms"])
        assert row["step_ms"] > 0
        assert math.isclose(row["tokens_per_s"], row["local_tokens"] / (row["step_ms"] / 1e3))
    # candidate blocks (own block + 1 summed over the local queries, blocks of 16): rank 0
    # holds positions 0-15 of document 1 and 8-23 of document 2, rank 1 positions 16-39 of
    # document 1 and 0-7 of document 2.
    assert rows[(64, 2, 0)]["candidate_blocks"] == 16 * 1 + 8 * 1 + 8 * 2
    assert rows[(64, 2, 1)]["candidate_blocks"] == 16 * 2 + 8 * 3 + 8 * 1
    summary = result["summary"]["64:2"]
    assert set(summary["step_ms"]) == {"0", "1"} and summary["max_over_min"] >= 1
    assert summary["ratio_to_baseline"] > 0


def test_time_budget_and_bad_pairs(tmp_path):
    proc = _run(tmp_path, "--cp", "64:2", "--baseline", "32", "--time-budget-s", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "cp.json").read_text())
    assert [r["status"] for r in result["rows"]] == ["skipped"] * 3
    (tmp_path / "cp.json").unlink()
    proc = _run(tmp_path, "--cp", "100:3")
    assert proc.returncode != 0 and "multiple of 2 * CP" in proc.stderr
    assert not (tmp_path / "cp.json").exists()
