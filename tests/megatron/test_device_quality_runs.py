"""``python -m benchmarks.device quality_runs`` on the CPU (quality_bench.py --tiny): the arms
train at once, each in its own process; a second call resumes them from their checkpoints; once
every arm has its steps the summary evaluates them at a longer length, and the metrics and logs
come back in one archive."""

from __future__ import annotations

import json
import tarfile

import pytest
from _device import run_stage

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

ARGS = "--tiny --steps 4 --seq-lengths 256 train.eval_interval=2"


def _steps(metrics: bytes) -> list[int]:
    return [json.loads(line)["iteration"] for line in metrics.decode().splitlines()
            if "loss" in json.loads(line)]


def test_quality_runs_stage_resumes_the_arms_then_summarizes(tmp_path, monkeypatch, capfd):
    common = ("quality_runs", "--dir", tmp_path / "runs", "--corpus-dir", tmp_path / "corpus",
              "--seconds", "300", "--final", "--extrapolate-to 512 --final-probe-rows 2")
    # Not finished after the first call: a status, not a failure of the stage.
    assert run_stage(monkeypatch, *common, "--out", tmp_path / "out1", "--qb-args",
                     f"{ARGS} train.exit_interval=2") == 0
    first = capfd.readouterr().out
    assert "steps done: [2, 2, 2] of 4" in first and "summary rc" not in first, first[-3000:]
    with tarfile.open(tmp_path / "out1" / "quality_runs" / "runs.tgz") as tar:
        assert "./summary.log" not in tar.getnames() and "./arm_msa.log" in tar.getnames()
    assert run_stage(monkeypatch, *common, "--out", tmp_path / "out2", "--qb-args", ARGS) == 0
    second = capfd.readouterr().out
    assert "steps done: [4, 4, 4] of 4" in second and "summary rc 0" in second, second[-3000:]
    out = tmp_path / "out2" / "quality_runs"
    report = json.loads((out / "quality.json").read_text())
    assert set(report["lengths"]) == {"256", "256_at_512"}
    assert {arm: r["steps"] for arm, r in report["lengths"]["256"]["runs"].items()} == {
        "dense": 4, "control": 4, "msa": 4}
    with tarfile.open(out / "runs.tgz") as tar:
        names = tar.getnames()
        assert {"./arm_dense.log", "./summary.log", "seq256/msa/metrics.jsonl",
                "seq256_at512/dense/metrics.jsonl"} <= set(names), names
        # The second call continued the first: steps 1-2 once, then 3-4.
        assert _steps(tar.extractfile("seq256/msa/metrics.jsonl").read()) == [1, 2, 3, 4]
