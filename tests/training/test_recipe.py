"""Recipe loading, overrides and the documented error messages (no training)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nemo_msa.training.recipe import (
    DEFAULT_RECIPE,
    RECIPES_DIR,
    RecipeError,
    check_parallel_layout,
    load_recipe,
)

REPO = Path(__file__).resolve().parents[2]


def test_default_recipe_is_msa_tiny_and_overrides_apply():
    recipe = load_recipe(None, ["train.train_iters=7", "optimizer.lr=1e-3", "model.msa_topk=2",
                                "dataset.data_path=null", "+logger.plot=false"])
    assert recipe.source == str(DEFAULT_RECIPE)
    assert recipe.train.train_iters == 7
    assert recipe.optimizer["lr"] == pytest.approx(1e-3)
    assert recipe.model["msa_topk"] == 2
    assert recipe.logger.plot is False
    # GPTModel arguments are split off the TransformerConfig fields.
    assert recipe.gpt.seq_length == 512 and "seq_length" not in recipe.model


@pytest.mark.parametrize("name", ["msa_tiny.yaml", "minimax_m3_msa.yaml",
                                  "msa_pp2_vpp2_tp2.yaml"])
def test_shipped_recipes_make_valid_msa_configs(name):
    import torch

    from nemo_msa.training.trainer import RunContext, build_config

    recipe = load_recipe(RECIPES_DIR / name)
    # As on a GPU node (no CPU restrictions): the config class validates every field.
    config = build_config(recipe, RunContext(0, 1, torch.device("cpu"), False, False))
    assert type(config).__name__ == "MSATransformerConfig"
    if name == "minimax_m3_msa.yaml":
        assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (
            64, 4, 128)
        assert (config.msa_num_index_heads, config.msa_index_head_dim, config.msa_block_size,
                config.msa_topk) == (4, 128, 128, 16)
        assert recipe.gpt.rotary_base == 5_000_000 and recipe.gpt.rotary_percent == 0.5
        # TP x PP = 8 GPUs per replica; 8..64 GPUs give DP 1..8.
        for world in (8, 16, 32, 64):
            assert check_parallel_layout(recipe.model, world, recipe.train.global_batch_size,
                                         recipe.train.micro_batch_size, config.num_layers)


def test_cpu_refuses_what_megatron_cannot_run_there():
    import torch

    from nemo_msa.training.trainer import RunContext, build_config

    cpu = RunContext(0, 1, torch.device("cpu"), True, False)
    with pytest.raises(RecipeError, match=r"'model.bf16' = True: expected false on the CPU"):
        build_config(load_recipe(None, ["model.bf16=true"]), cpu)


def test_unknown_key_names_key_section_and_valid_keys():
    with pytest.raises(RecipeError) as err:
        load_recipe(None, ["model.hiden_size=64"])
    msg = str(err.value)
    assert "'model.hiden_size' is unknown" in msg
    assert "Did you mean 'hidden_size'" in msg
    assert "Valid keys of section 'model'" in msg and "msa_topk" in msg


def test_unknown_section_and_malformed_override():
    with pytest.raises(RecipeError, match=r"recipe section 'trian' is unknown.*'train'"):
        load_recipe(None, ["trian.train_iters=3"])
    with pytest.raises(RecipeError, match=r"not of the form section.key=value"):
        load_recipe(None, ["train.train_iters"])
    with pytest.raises(RecipeError, match=r"must name a section and a field"):
        load_recipe(None, ["train_iters=3"])


def test_bad_values_are_named():
    with pytest.raises(RecipeError, match=r"'train.global_batch_size' = 3: expected a positive "
                                          r"multiple of train.micro_batch_size \(2\)"):
        load_recipe(None, ["train.micro_batch_size=2", "train.global_batch_size=3"])
    with pytest.raises(RecipeError, match=r"'scheduler.lr_warmup_iters' = 9"):
        load_recipe(None, ["train.train_iters=5", "scheduler.lr_warmup_iters=9"])
    with pytest.raises(RecipeError, match=r"'optimizer.min_lr' = 0.003: expected <= "
                                          r"optimizer.lr \(0.001\)"):
        load_recipe(None, ["optimizer.lr=1e-3", "optimizer.min_lr=3e-3"])
    with pytest.raises(RecipeError, match=r"use_checkpoint_opt_param_scheduler' = True: expected "
                                          r"false when scheduler.override_opt_param_scheduler"):
        load_recipe(None, ["scheduler.override_opt_param_scheduler=true",
                           "scheduler.use_checkpoint_opt_param_scheduler=true"])
    with pytest.raises(RecipeError, match=r"recipe file '.*nope.yaml' does not exist"):
        load_recipe("nope.yaml")


def test_parallel_layout_must_divide_world_size():
    model = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    with pytest.raises(RecipeError, match=r"tensor_model_parallel_size=2 x "
                                          r"pipeline_model_parallel_size=2 x "
                                          r"context_parallel_size=1 = 4, but the world size is 6"):
        check_parallel_layout(model, 6, 8, 1, 4)
    assert check_parallel_layout(model, 8, 8, 1, 4) == 2
    with pytest.raises(RecipeError, match=r"'model.num_layers' = 6: expected a multiple of"):
        check_parallel_layout({**model, "virtual_pipeline_model_parallel_size": 2}, 4, 8, 1, 6)


def test_missing_dataset_path_is_named(tmp_path):
    from nemo_msa.training.data import build_train_dataset

    recipe = load_recipe(None, [f"dataset.data_path=[{tmp_path}/corpus]"])
    with pytest.raises(RecipeError, match=r"dataset prefix '.*corpus' has no .*corpus.bin and "
                                          r"no .*corpus.idx"):
        build_train_dataset(recipe.dataset, recipe.gpt, 1, 8)


def test_cli_reports_bad_key_and_exits_2():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "pretrain.py"), "model.hiden_size=64"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2
    assert "error: recipe key 'model.hiden_size' is unknown" in proc.stderr
