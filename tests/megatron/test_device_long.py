"""``python -m benchmarks.device long_tests`` and ``long_rows`` on the CPU (issue 63): the
long-sequence GPU tests run in their own bounded call with their counts printed (here they
skip, naming the reason), and the row search runs bench_layer.py --grow-to with the stage's
arguments, its longest row in the JSON and in the output."""

from __future__ import annotations

import json

import pytest
import torch
from _device import run_stage

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU the stage runs the long tests themselves (minutes)")
def test_long_tests_stage_prints_the_counts_and_the_status(tmp_path, monkeypatch, capfd):
    out = tmp_path / "out"
    assert run_stage(monkeypatch, "long_tests", "--out", out, "--seconds", "300") == 0
    log = (out / "long_tests.log").read_text()
    assert "3 skipped" in log and "needs a CUDA GPU" in log, log
    printed = capfd.readouterr().out.splitlines()
    assert "rc 0" in printed and any("3 skipped" in line for line in printed), printed
    record = json.loads((out / "long_tests.run.json").read_text())
    assert record["summary"]["status"] == 0


def test_long_rows_stage_searches_the_longest_row(tmp_path, monkeypatch, capfd):
    out = tmp_path / "out"
    assert run_stage(monkeypatch, "long_rows", "--out", out, "--tokens", "64", "--grow-to",
                     "128", "--args", "--tiny --cpu --steps 1", "--seconds", "300") == 0
    result = json.loads((out / "long.json").read_text())
    assert [(r["tokens"], r["case"], r["status"]) for r in result["rows"]] == [
        (64, "msa_sparse_loss", "ok"), (128, "msa_sparse_loss", "ok")]
    assert result["longest"]["msa_sparse_loss"]["tokens"] == 128
    printed = capfd.readouterr().out
    assert "msa_sparse_loss: longest row that ran 128 tokens" in printed, printed
    assert "rc 0" in (out / "long.log").read_text()
