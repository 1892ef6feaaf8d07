"""recipes/minimax_m3_tiny.yaml (MiniMax-M3's architecture at toy size: MoE with a shared
expert, SwiGLU-OAI, Gemma norms, dense attention then MSA) trains on the CPU with M3's
multi-token-prediction module (``model.mtp_num_layers=1``): the LM and the MTP loss fall."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _runs import pretrain_cli

from nemo_msa.training.recipe import RECIPES_DIR, load_recipe
from nemo_msa.training.trainer import pretrain, teardown


def test_tiny_m3_recipe_trains_with_mtp_and_both_losses_fall(tmp_path):
    recipe = load_recipe(RECIPES_DIR / "minimax_m3_tiny.yaml",
                         ["train.train_iters=8", f"logger.output_dir={tmp_path}",
                          "model.mtp_num_layers=1"])
    try:
        summary = pretrain(recipe)
    finally:
        teardown()
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 8
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    assert summary["attention"] == "MSA in 3 of 4 layers (pattern DSSS)"
    assert summary["last phase"] == "sparse"
    # Layers 2-4 are MoE with 8 experts of 32 and a shared expert: 0.32M parameters; the MTP
    # module (an MSA + MoE layer, its norms and eh_proj [64, 128]) adds 0.08M.
    assert summary["parameters"] == "0.40M", summary
    # The MTP loss (token i + 2 from position i) is logged beside the LM loss and falls too.
    mtp = [h["mtp_loss"] for h in summary["history"]]
    assert sum(mtp[-3:]) / 3 < mtp[0] - 0.3, mtp
    assert summary["final MTP loss"] == mtp[-1]
    rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    assert [r["mtp_loss"] for r in rows] == mtp


@pytest.mark.gpu
def test_tiny_m3_recipe_trains_with_mtp_on_the_gpu(tmp_path):
    """On the GPU (bf16, the Triton kernels): the MTP module's MSA layer runs the kernels, and
    the LM and MTP losses are finite and fall over 20 steps."""
    rows = pretrain_cli(tmp_path / "m3", "model.mtp_num_layers=1", "model.bf16=true",
                        "optimizer.clip_grad=1.0", "model.msa_backend=triton",
                        "train.train_iters=20", recipe="minimax_m3_tiny.yaml")
    lm, mtp = [r["loss"] for r in rows], [r["mtp_loss"] for r in rows]
    print(json.dumps({"loss": lm, "mtp_loss": mtp}))
    assert len(mtp) == 20 and all(math.isfinite(v) for v in lm + mtp)
    assert sum(lm[-3:]) / 3 < lm[0] - 0.5 and sum(mtp[-3:]) / 3 < mtp[0] - 0.3, (lm, mtp)
