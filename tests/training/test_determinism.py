"""``model.deterministic_mode``'s process settings (ADR 0050): Megatron-LM's values, set before
CUDA starts and undone at teardown; bad environments are one recipe error. The runs it makes
bitwise repeatable are tests/training/test_restart.py's."""

from __future__ import annotations

import os

import pytest
import torch

from nemo_msa.training import determinism
from nemo_msa.training.recipe import RecipeError

VARIABLES = ("CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NCCL_ALGO")


def test_the_settings_are_megatron_lms():
    from megatron.training import determinism as megatron_lm

    assert determinism.ENV_DEFAULTS == megatron_lm.DETERMINISM_ENV_VAR_DEFAULTS
    assert determinism.ACCEPTED_VALUES == megatron_lm.ACCEPTED_ENV_VAR_VALUES
    assert determinism.ACCEPTED_NCCL_ALGOS == megatron_lm.ACCEPTED_NCCL_ALGO_TOKENS
    assert determinism.REQUIRED_MODEL_VALUES == megatron_lm.ARG_VALUES_REQUIRED_FOR_DETERMINISM


def test_enable_sets_what_is_unset_and_restore_undoes_it(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other accepted value stays
    assert not torch.are_deterministic_algorithms_enabled()
    undo = determinism.enable()
    try:
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
        assert os.environ["NCCL_ALGO"] == "Ring"
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        determinism.restore(undo)
    assert sorted(undo.env_set) == ["NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"]
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert "NCCL_ALGO" not in os.environ and "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize(("name", "value", "message"), [
    ("CUBLAS_WORKSPACE_CONFIG", ":0:0", r"sets CUBLAS_WORKSPACE_CONFIG=':0:0'; expected unset or "
                                        r"one of :16:8, :4096:8"),
    ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1",
     r"sets NVTE_ALLOW_NONDETERMINISTIC_ALGO='1'; expected unset or one of 0"),
    ("NCCL_ALGO", "Tree", r"sets NCCL_ALGO='Tree'; expected unset or tokens of CollnetChain, "
                          r"CollnetDirect, Ring, \^NVLS \(NCCL's tree and NVLS reductions"),
])
def test_a_nondeterministic_environment_is_one_recipe_error(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(RecipeError, match=r"^recipe key 'model.deterministic_mode' = True: the "
                                          r"environment " + message):
        determinism.enable()
    assert not torch.are_deterministic_algorithms_enabled()


def test_cuda_started_without_the_cublas_setting_is_refused(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RecipeError, match=r"CUDA is already initialised in this process, so "
                                          r"cuBLAS keeps its workspace; set "
                                          r"CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment"):
        determinism.enable()
