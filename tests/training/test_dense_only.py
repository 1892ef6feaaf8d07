"""A model whose pattern has no MSA layer trains, and its step metrics reduce (issue #26 item 3).

With zero MSA layers no layer records indexer metrics, so the metrics table has no recorded
tensor to take its device from; it must still be all-reduced where the backend reduces (CUDA for
NCCL: tests/training/test_context_parallel_data.py checks the device choice; here gloo, end to end).
"""

from __future__ import annotations

import json
import math

from _runs import train


def test_dense_only_pattern_trains_and_logs_no_indexer_metrics(tmp_path):
    summary = train(["train.train_iters=3", "model.msa_dense_warmup_steps=1",
                      "model.msa_layer_pattern=DDDD", f"logger.output_dir={tmp_path}",
                      "logger.plot=false"])
    assert summary["attention"] == "MSA" and summary["last phase"] == "sparse"
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert not any("indexer_loss" in r or "recall" in r for r in rows)
