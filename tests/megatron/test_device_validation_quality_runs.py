"""benchmarks/device_validation.sh's "quality_runs" stage on the CPU (quality_bench.py --tiny):
the arms train at once, each in its own process; a second call resumes them from their
checkpoints; once every arm has its steps the summary evaluates them at a longer length, and the
metrics and logs come back in one archive."""

from __future__ import annotations

import json
import shutil
import tarfile

import pytest
from _device_validation import run_stages

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

ARGS = "--tiny --steps 4 --seq-lengths 256 train.eval_interval=2"


def _steps(metrics: bytes) -> list[int]:
    return [json.loads(line)["iteration"] for line in metrics.decode().splitlines()
            if "loss" in json.loads(line)]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_quality_runs_stage_resumes_the_arms_then_summarizes(tmp_path):
    settings = dict(STAGES="quality_runs", QR_DIR=str(tmp_path / "runs"),
                    QR_CORPUS_DIR=str(tmp_path / "corpus"), QR_S="300",
                    QR_FINAL="--extrapolate-to 512 --final-probe-rows 2")
    first = run_stages(tmp_path / "out1", QR_ARGS=f"{ARGS} train.exit_interval=2", **settings)
    assert "steps done: [2, 2, 2] of 4" in first.stdout, first.stdout[-3000:]
    assert not (tmp_path / "out1" / "quality_runs" / "summary.log").exists()
    second = run_stages(tmp_path / "out2", QR_ARGS=ARGS, **settings)
    assert "steps done: [4, 4, 4] of 4" in second.stdout and "summary rc 0" in second.stdout, \
        second.stdout[-3000:]
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
