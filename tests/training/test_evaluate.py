"""Evaluation in the training loop: val_loss rows, no effect on training, buckets, layouts.

Runs use the shrunk default recipe of ``_runs.SMALL`` (Megatron mock documents), in this process.
The forward-only schedule under the parallel layouts (TP2, PP2 and PP2 x VPP2, each with CP2)
gives the single-process validation losses: tests/training/test_context_parallel_runs.py, whose
torchrun runs end with an evaluation of the weights one process evaluates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _runs import train

from nemo_msa.training.evaluate import bucket_names, position_bucket_edges
from nemo_msa.training.recipe import RecipeError


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_position_buckets_scale_with_the_row_length():
    assert position_bucket_edges(32768) == [0, 1024, 4096, 16384]
    assert position_bucket_edges(8192) == [0, 1024, 4096]
    assert position_bucket_edges(4096) == [0, 1024]
    assert position_bucket_edges(512) == [0, 32, 128]
    assert position_bucket_edges(256) == [0, 16, 64]
    assert position_bucket_edges(8) == [0, 1, 4]
    assert bucket_names([0, 1024, 4096, 16384], 32768) == [
        "pos_0-1k", "pos_1k-4k", "pos_4k-16k", "pos_16k-32k"]


def test_eval_interval_writes_val_loss_rows_and_leaves_training_unchanged(tmp_path):
    common = ["train.train_iters=5", "model.msa_dense_warmup_steps=2"]
    with_eval = train([*common, "train.eval_interval=2", "train.eval_iters=2",
                       f"logger.output_dir={tmp_path / 'eval'}"])
    without = train([*common, f"logger.output_dir={tmp_path / 'plain'}"])
    rows = _rows(tmp_path / "eval")
    evaluated = [r["iteration"] for r in rows if "val_loss" in r]
    assert evaluated == [2, 4, 5]  # every 2 steps plus the final evaluation
    for r in rows:
        if "val_loss" not in r:
            continue
        assert math.isfinite(r["val_loss"]) and 0 < r["val_loss"] < 7
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12)
        buckets = [v for k, v in r.items() if k.startswith("val_loss/pos_")]
        assert len(buckets) == 3  # 256-token rows: [0, 16), [16, 64), [64, 256)
        assert min(buckets) <= r["val_loss"] <= max(buckets)
    # The validation loss falls as the model learns the mock documents.
    assert rows[-1]["val_loss"] < rows[1]["val_loss"] - 0.1
    # No gradients, no optimizer state, no data position: training is bitwise the same.
    assert [h["loss"] for h in with_eval["history"]] == [h["loss"] for h in without["history"]]
    assert with_eval["val loss"] == rows[-1]["val_loss"]
    assert not any("val_loss" in r for r in _rows(tmp_path / "plain"))
    # Model FLOPs are logged per step; no MFU without a GPU peak.
    assert all(r["tflops_per_gpu"] > 0 and "mfu" not in r for r in rows)
    assert with_eval["TFLOP/s per GPU"] > 0 and "MFU" not in with_eval


def test_exit_duration_stops_after_one_step_with_a_final_evaluation(tmp_path):
    summary = train(["train.train_iters=50", "model.msa_dense_warmup_steps=1",
                     "train.eval_interval=20", "train.eval_iters=1",
                     "train.exit_duration_in_mins=1e-9", f"logger.output_dir={tmp_path}"])
    assert summary["steps"] == "1/50"
    rows = _rows(tmp_path)
    assert len(rows) == 1 and "val_loss" in rows[0]


def test_evaluation_without_a_validation_split_is_an_error(tmp_path):
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n in range(20):
        doc = list(range(1, 100 + n)) + [255]
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    # (Megatron's mock data draws every split independently, so only real data can lack one.)
    with pytest.raises(RecipeError, match=r"dataset.split' = '100,0,0'.*validation split is "
                       r"empty.*train.eval_interval = 2"):
        train(["train.train_iters=2", "train.eval_interval=2", "dataset.split=100,0,0",
               f"dataset.data_path=[{prefix}]", f"logger.output_dir={tmp_path}"])
    with pytest.raises(RecipeError, match=r"train.eval_iters' = 0"):
        train(["train.eval_interval=2", "train.eval_iters=0"])


def test_copy_marker_is_a_token_id_of_a_run_without_context_parallelism():
    from nemo_msa.training.recipe import load_recipe

    with pytest.raises(RecipeError, match=r"train.eval_copy_marker' = 300: expected a token id "
                       r"below model.vocab_size = 257"):
        load_recipe(None, ["model.vocab_size=257", "train.eval_copy_marker=300"])
    with pytest.raises(RecipeError, match=r"train.eval_copy_marker' = -1"):
        load_recipe(None, ["train.eval_copy_marker=-1"])
    with pytest.raises(RecipeError, match=r"train.eval_copy_marker' = 0: expected null with "
                       r"model.context_parallel_size > 1"):
        load_recipe(None, ["train.eval_copy_marker=0", "model.context_parallel_size=2",
                           "model.seq_length=256"])
    assert load_recipe(None, ["train.eval_copy_marker=0"]).train.eval_copy_marker == 0

