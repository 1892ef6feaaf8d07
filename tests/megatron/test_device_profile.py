"""``python -m benchmarks.device profile`` on the CPU (bench_layer.py --tiny --cpu): dense and
MSA rows are profiled with their traces in one process, every MSA trace is attributed minus the
dense trace of its row, and the short rows' traces come back gzipped."""

from __future__ import annotations

import json
import tarfile

import pytest
from _device import run_stage

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)


def test_profile_stage_attributes_each_msa_trace_against_its_dense_row(tmp_path, monkeypatch):
    out, traces = tmp_path / "out", tmp_path / "traces"
    assert run_stage(monkeypatch, "profile", "--out", out, "--rows", "64,128:32", "--trace-dir",
                     traces, "--args", "--tiny --cpu --steps 1 --warmup 1 --profile-top 3",
                     "--seconds", "400") == 0
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
        assert "GPU idle before the kernels of, minus the base's (ms):" in attribution
    assert "Traceback" not in attribution, attribution
    with tarfile.open(out / "traces_short.tgz") as tar:
        assert sorted(tar.getnames()) == names
