"""The dense baseline: an MSA config whose pattern has no MSA layer trains like any model.

With zero MSA layers no layer records indexer metrics, so the metrics table has no recorded
tensor to take its device from; it must still be all-reduced where the backend reduces (issue
#26 item 3: CUDA for NCCL, tests/training/test_context_parallel_data.py checks the device
choice; here gloo, end to end).
"""

from __future__ import annotations

import json
import math

import torch
from _runs import train

from nemo_msa.megatron import MSAIndexerMetrics


def test_dense_only_pattern_trains_and_logs_no_indexer_metrics(tmp_path):
    # What an earlier model in this process recorded and nobody popped is not this run's.
    MSAIndexerMetrics.record(1, {"kl": torch.tensor(0.5), "recall_mass": torch.tensor(0.25),
                                 "recall_count": torch.tensor(1.0)})
    summary = train(["train.train_iters=8", "model.msa_layer_pattern=DDDD",
                     "model.msa_dense_warmup_steps=2", "train.eval_interval=4",
                     "train.eval_iters=1", f"logger.output_dir={tmp_path}"])
    assert summary["attention"] == "MSA in 0 of 4 layers (pattern DDDD)"
    hist = summary["history"]
    assert len(hist) == 8
    assert sum(h["loss"] for h in hist[-3:]) / 3 < hist[0]["loss"] - 0.3, hist
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert not any("indexer_loss" in r or "recall" in r for r in rows)
    assert [r["iteration"] for r in rows if "val_loss" in r] == [4, 8]
