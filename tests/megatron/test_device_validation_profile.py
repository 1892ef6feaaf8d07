"""scripts/device_validation.sh's "profile" stage on the CPU (bench_layer.py --tiny --cpu): dense
and MSA rows are profiled with their traces in one process, and every MSA trace is attributed
minus the dense trace of its row."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_profile_stage_attributes_each_msa_trace_against_its_dense_row(tmp_path):
    out, traces = tmp_path / "out", tmp_path / "traces"
    env = {
        **os.environ,
        # The stage calls python3: the interpreter running the tests, with the package.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OUT": str(out),
        "STAGES": "profile",
        "PROFILE_ROWS": "64,128:32",
        "PROFILE_TRACE_DIR": str(traces),
        "PROFILE_ARGS": "--tiny --cpu --steps 1 --warmup 1 --profile-top 3",
        "PROFILE_S": "400",
    }
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_validation.sh")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "profile.log").read_text()
    assert "rc 0" in log, log[-3000:]
    rows = json.loads((out / "profile.json").read_text())["rows"]
    assert {(r["case"], r["tokens"], r["doc_mean"]) for r in rows} == {
        (case, tokens, mean) for case in ("dense", "msa_sparse_loss")
        for tokens, mean in ((64, 0), (128, 32))
    }
    assert all(r["status"] == "ok" and r["kernels"] for r in rows), rows
    names = sorted(p.name for p in traces.glob("*.json"))
    assert names == ["dense_128_mean32.json", "dense_64.json", "msa_sparse_loss_128_mean32.json",
                     "msa_sparse_loss_64.json"], names
    attribution = (out / "attribution.txt").read_text()
    for row in ("64", "128_mean32"):
        msa, dense = traces / f"msa_sparse_loss_{row}.json", traces / f"dense_{row}.json"
        assert f"== {msa}: GPU busy" in attribution, attribution
        assert f"-- minus {dense}: span" in attribution, attribution
    assert "Traceback" not in attribution, attribution
