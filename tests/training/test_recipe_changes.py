"""A resume names the recipe keys that differ from the checkpoint's recipe, and refuses those that
change the model or the data order unless ``checkpoint.allow_recipe_change=true`` (ADR 0049)."""

from __future__ import annotations

import re

import pytest
from _runs import REFERENCE, copy_checkpoint, losses, train

from nemo_msa.training.recipe import RecipeError, load_recipe
from nemo_msa.training.recipe_changes import (
    DATA_ORDER_KEYS,
    Difference,
    differences,
    format_block,
)


def _resolved(*overrides: str) -> dict:
    return load_recipe(None, list(overrides)).resolved


def test_differences_compare_values_as_typed_with_defaults_and_classify_keys():
    saved = _resolved("optimizer.lr=3e-3", "checkpoint.save=/a", "logger.log_interval=5")
    # The same values spelt otherwise, defaults written out, and where and how a run reports.
    same = _resolved("optimizer.lr=0.003", "model.transformer_impl=local",
                     "model.deterministic_mode=false", "train.exit_interval=null",
                     "checkpoint.save=/b", "checkpoint.allow_recipe_change=true",
                     "logger.log_interval=1", "dist.timeout_minutes=3")
    assert differences(saved, same) == []
    now = _resolved("model.msa_topk=2", "model.tensor_model_parallel_size=2",
                    "model.deterministic_mode=true", "train.train_iters=80", "train.seed=7",
                    "dataset.split=98,2,0", "optimizer.lr=1e-3")
    found = {d.key: d for d in differences(saved, now)}
    assert list(found) == sorted(found, key=lambda k: (
        ["model", "train", "optimizer", "dataset"].index(k.split(".")[0]), k))
    assert found["model.msa_topk"] == Difference("model.msa_topk", 4, 2, "changes the model")
    why = DATA_ORDER_KEYS["train.seed"]
    assert found["train.seed"].guarded == f"changes the data order ({why})"
    assert found["dataset.split"].guarded.startswith("changes the data order")
    for free in ("model.tensor_model_parallel_size", "model.deterministic_mode",
                 "train.train_iters", "optimizer.lr"):
        assert found[free].guarded is None, free
    assert found["model.deterministic_mode"].saved is False
    block = format_block(list(found.values()), "/ck/iter_0000003", enforced=True, allowed=False)
    lines = block.splitlines()
    assert lines[0] == "recipe changes since checkpoint /ck/iter_0000003 (7 keys):"
    assert "  model.msa_topk: 4 -> 2  [changes the model: refused without " \
           "checkpoint.allow_recipe_change=true]" in lines
    assert "  train.train_iters: 40 -> 80" in lines


def test_resume_lists_changes_and_refuses_the_model_and_data_order_unless_allowed(
        reference, tmp_path, capfd):
    ref_root, ref = reference
    copy_checkpoint(ref_root, 3, tmp_path / "ckpt")
    common = [*REFERENCE, f"checkpoint.save={tmp_path / 'ckpt'}"]
    capfd.readouterr()
    with pytest.raises(RecipeError, match=r"^recipe keys 'model.msa_topk' = 1 \(checkpoint: 2\), "
                                          r"'train.seed' = 9 \(checkpoint: 1234\) differ from "
                                          r"the recipe checkpoint .*iter_0000003 was saved with "
                                          r"and change the model or the data order: resume with "
                                          r"the checkpoint's values, or pass "
                                          r"checkpoint.allow_recipe_change=true"):
        train([*common, "model.msa_topk=1", "train.seed=9", "logger.log_interval=3"])
    err = capfd.readouterr().err
    block = err[err.index("recipe changes since checkpoint"):].splitlines()[:3]
    assert re.fullmatch(r"recipe changes since checkpoint .*iter_0000003 \(2 keys\):", block[0])
    assert block[1:] == [
        "  model.msa_topk: 2 -> 1  [changes the model: refused without "
        "checkpoint.allow_recipe_change=true]",
        "  train.seed: 1234 -> 9  [changes the data order (the data order and the random "
        "streams): refused without checkpoint.allow_recipe_change=true]"]
    with pytest.raises(RecipeError, match=r"^recipe key 'model.msa_topk' = 1 differs from the "
                                          r"recipe checkpoint .* was saved with \(2\) and "
                                          r"changes the model: resume with the checkpoint's "
                                          r"value"):
        train([*common, "model.msa_topk=1"])
    # Allowed: listed, marked, and the run goes on (one step of the changed model).
    capfd.readouterr()
    summary = train([*common, "model.msa_topk=1", "train.exit_interval=1",
                     "checkpoint.allow_recipe_change=true"])
    assert "allowed by checkpoint.allow_recipe_change=true" in capfd.readouterr().err
    assert sorted(losses(summary["history"])) == [1, 2, 3, 4]
    assert losses(summary["history"])[3] == losses(ref["history"])[3]
