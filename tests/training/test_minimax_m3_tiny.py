"""recipes/minimax_m3_tiny.yaml (MiniMax-M3's architecture at toy size: MoE with a shared
expert, SwiGLU-OAI, Gemma norms, dense attention then MSA) trains on the CPU: the loss falls."""

from __future__ import annotations

from nemo_msa.training.recipe import RECIPES_DIR, load_recipe
from nemo_msa.training.trainer import pretrain, teardown


def test_tiny_m3_recipe_trains_and_loss_falls(tmp_path):
    recipe = load_recipe(RECIPES_DIR / "minimax_m3_tiny.yaml",
                         ["train.train_iters=8", f"logger.output_dir={tmp_path}"])
    try:
        summary = pretrain(recipe)
    finally:
        teardown()
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 8
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    assert summary["attention"] == "MSA in 3 of 4 layers (pattern DSSS)"
    assert summary["last phase"] == "sparse"
    # Layers 2-4 are MoE with 8 experts of 32 and a shared expert: 0.32M parameters in all.
    assert summary["parameters"] == "0.32M", summary
