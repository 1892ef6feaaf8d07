"""benchmarks/device_validation.sh's "per_token" stage: it runs
benchmarks/per_token_variants.py with PER_TOKEN_ARGS into $OUT/per_token.log (and .json) and
records the exit status. On the CPU the script refuses (it times GPU kernels) and says why; on a
GPU it writes a row whose key-split kernels agree with the production ones."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _device_validation import run_stages

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_per_token_stage_runs_the_script_and_records_its_status(tmp_path):
    out = tmp_path / "out"
    run_stages(out, STAGES="per_token", PER_TOKEN_ARGS="--tokens 256 --reps 1",
               PER_TOKEN_S="300")
    log = (out / "per_token.log").read_text()
    assert log.startswith("== per_token: benchmarks/per_token_variants.py --tokens 256 --reps 1\n")
    if not torch.cuda.is_available():
        assert "per_token_variants.py needs a CUDA GPU" in log, log
        assert log.rstrip().endswith("rc 1"), log
        return
    assert log.rstrip().endswith("rc 0"), log
    (row,) = json.loads((out / "per_token.json").read_text())
    assert row["tokens"] == 256 and row["prod_fwd_ms"] > 0 and row["gather_w4_tbs"] > 0
    errors = [e for key, e in row.items() if key.startswith("split_fwd_") and
              key.endswith("_err")]
    assert errors and all(max(e) < 1e-2 for e in errors), row
    assert all(e < 2e-2 for key, e in row.items() if key.startswith("split_dq_")
               and key.endswith("_err")), row
