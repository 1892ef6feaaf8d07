"""``model.deterministic_mode``'s process settings (ADR 0050): Megatron-LM's values, set before
CUDA starts and undone at teardown; bad environments are one recipe error. The runs it makes
bitwise repeatable are tests/training/test_restart.py's; benchmarks/determinism_check.py (the
GPU check) is tested here on what the CPU can check."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _runs import SMALL

from nemo_msa.training import determinism
from nemo_msa.training.recipe import RecipeError

REPO = Path(__file__).resolve().parents[2]
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


def _check_script():
    spec = importlib.util.spec_from_file_location(
        "determinism_check", REPO / "benchmarks" / "determinism_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_checks_verdicts_name_the_first_difference(tmp_path):
    """benchmarks/determinism_check.py's comparisons (its GPU runs are the device's)."""
    script = _check_script()
    a = {1: {"loss": 5.5, "indexer_loss": 1.0}, 2: {"loss": 5.25, "grad_norm": float("nan")}}
    assert script.first_difference(a, copy.deepcopy(a)) is None  # NaN equals NaN
    b = {1: dict(a[1]), 2: {"loss": 5.25 + 2 ** -50, "grad_norm": float("nan")}}
    assert script.first_difference(a, b) == (
        f"loss differs first at step 2 (5.25 against {5.25 + 2 ** -50!r})")
    assert script.first_difference(a, {1: a[1]}) == "step 2 is in only one run (a)"
    assert script.check("x", [None, None])["passed"]
    verdict = script.check("y", [None, "iter_0000004 differs in rng_state"])
    assert not verdict["passed"] and verdict["line"] == (
        "y: FAIL: iter_0000004 differs in rng_state")
    with pytest.raises(SystemExit, match=r"--interrupt-at=4 --steps=4: expected 0 < "
                                         r"interrupt-at < steps"):
        script.main(["--out", str(tmp_path / "o"), "--steps", "4", "--interrupt-at", "4"])
    assert not (tmp_path / "o").exists()


@pytest.mark.bench
def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    """The whole script on the CPU (reference backend, fp32): four small runs, PASS, and the
    cost rows of bench_layer.py's tiny model."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "determinism_check.py"), "--out",
         str(tmp_path / "out"), "--cpu", "--steps", "3", "--interrupt-at", "2",
         "--cost-tokens", "64", "--cost-cases", "dense", "--", *SMALL,
         "model.msa_dense_warmup_steps=1"],
        capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = [line for line in proc.stdout.splitlines() if line.endswith(": PASS")]
    assert len(verdicts) == 4 and "determinism check: PASS (4 checks)" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "determinism.json", "determinism.log", "layer_default.json", "layer_deterministic.json"]
    report = json.loads((tmp_path / "out" / "determinism.json").read_text())
    assert all(c["passed"] for c in report["checks"]) and report["gpu"] == "cpu"
    assert sorted(report["runs"]) == ["a", "b", "c"] and len(report["runs"]["c"]) == 3
    assert report["digests_a"]["iter_0000003"] and report["digests_a"]["iter_0000002"]
    (row,) = report["cost"]
    assert row["case"] == "dense" and row["cost"] > 0
