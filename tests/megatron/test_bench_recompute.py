"""benchmarks/bench_recompute.py end to end on the CPU (--tiny, gloo, the CPU shim), in a subprocess
(the script owns its process group): every mode gives the reference's loss and gradients bit for
bit and scores once per layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_recompute.py"), "--tiny", "--layers",
           "2", "--steps", "1", "--json", str(tmp_path / "recompute.json"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_tiny_run_compares_every_mode_to_no_recompute(tmp_path):
    proc = _run(tmp_path, "--tokens", "128")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "recompute.json").read_text())["rows"]
    assert [row["mode"] for row in rows] == ["none", "full", "selective"]
    for row in rows:
        assert row["status"] == "ok" and row["step_ms"] > 0 and row["repeatable"], row
        assert row["selections"] == 2, row  # one per MSA layer: the recompute replays
    assert rows[0]["reference"]
    assert all(row["bitwise"] and row["max_grad_diff"] == 0.0 for row in rows[1:]), rows


def test_bad_arguments_fail_before_anything_is_built(tmp_path):
    proc = _run(tmp_path, "--modes", "none,offload")
    assert proc.returncode != 0 and "unknown ['offload']" in proc.stderr
    proc = _run(tmp_path, "--tokens", "100")
    assert proc.returncode != 0 and "multiples of the block size 16" in proc.stderr
    assert not (tmp_path / "recompute.json").exists()
