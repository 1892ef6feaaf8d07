"""Deterministic runs (``model.deterministic_mode``): the process settings, made before CUDA starts.

Megatron-Core's ``deterministic_mode`` config field picks deterministic code inside Megatron (its
embedding's backward, for one). Megatron-LM's ``--deterministic-mode`` also sets three
environment variables and ``torch.use_deterministic_algorithms(True)``
(``megatron/training/determinism.py``); :func:`enable` does the same for a recipe with the key,
before the process group and CUDA start, and :func:`restore` undoes it at teardown. The values
mirror Megatron-LM's (a test compares them): importing ``megatron.training`` for them would load
Megatron-LM's training stack (126 modules). What the mode makes deterministic, and what it costs,
is ADR 0050.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from nemo_msa.training.recipe_fields import RecipeError

#: Environment variables the mode sets where they are unset (Megatron-LM's
#: ``DETERMINISM_ENV_VAR_DEFAULTS``): cuBLAS with a fixed workspace per stream (no split-K
#: reductions whose order depends on the workspace), Transformer Engine without its
#: non-deterministic kernels, NCCL's ring all-reduce (NVLS and tree orders vary).
ENV_DEFAULTS: dict[str, str] = {
    "NCCL_ALGO": "Ring",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
#: The values a variable may already hold under the mode (Megatron-LM's
#: ``ACCEPTED_ENV_VAR_VALUES``; NVIDIA documents both cuBLAS workspace settings).
ACCEPTED_VALUES: dict[str, frozenset[str]] = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": frozenset({"0"}),
    "CUBLAS_WORKSPACE_CONFIG": frozenset({":4096:8", ":16:8"}),
}
#: ``NCCL_ALGO`` tokens accepted under the mode (Megatron-LM's ``ACCEPTED_NCCL_ALGO_TOKENS``).
ACCEPTED_NCCL_ALGOS = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
#: Config fields the mode needs at these values (Megatron-LM's
#: ``ARG_VALUES_REQUIRED_FOR_DETERMINISM``): the fused cross entropy and TP communication
#: overlap have no deterministic form.
REQUIRED_MODEL_VALUES: dict[str, bool] = {"cross_entropy_loss_fusion": False,
                                          "tp_comm_overlap": False}


@dataclass
class Undo:
    """What :func:`enable` changed in this process, for :func:`restore`."""

    #: The environment variables set here (they were unset).
    env_set: list[str] = field(default_factory=list)
    #: ``torch.use_deterministic_algorithms``' mode and warn_only before.
    torch_mode: tuple[bool, bool] = (False, False)


def check_environment(env: dict[str, str] | os._Environ) -> None:
    """The determinism variables already set hold deterministic values.

    Raises:
        RecipeError: naming ``model.deterministic_mode``, the variable, its value and the
            accepted ones.
    """
    for name, accepted in ACCEPTED_VALUES.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            raise RecipeError(f"recipe key 'model.deterministic_mode' = True: the environment "
                              f"sets {name}={value!r}; expected unset or one of "
                              f"{', '.join(sorted(accepted))}")
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or not set(tokens) <= ACCEPTED_NCCL_ALGOS:
            raise RecipeError(f"recipe key 'model.deterministic_mode' = True: the environment "
                              f"sets NCCL_ALGO={algo!r}; expected unset or tokens of "
                              f"{', '.join(sorted(ACCEPTED_NCCL_ALGOS))} (NCCL's tree and NVLS "
                              "reductions are not bitwise repeatable)")


def enable() -> Undo:
    """Set the mode's environment and ``torch.use_deterministic_algorithms(True)``.

    Must run before CUDA starts: cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when it creates its
    first handle, while torch's check of it reads the environment at every call, so a setting
    made after the first GEMM would pass that check and still run the old workspace.

    Returns:
        What to undo (:func:`restore`).

    Raises:
        RecipeError: a determinism variable holds another value, or CUDA is already
            initialised in this process without ``CUBLAS_WORKSPACE_CONFIG`` set.
    """
    check_environment(os.environ)
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ and torch.cuda.is_initialized():
        raise RecipeError("recipe key 'model.deterministic_mode' = True: CUDA is already "
                          "initialised in this process, so cuBLAS keeps its workspace; set "
                          "CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before the "
                          "process starts")
    undo = Undo(torch_mode=(torch.are_deterministic_algorithms_enabled(),
                            torch.is_deterministic_algorithms_warn_only_enabled()))
    for name, value in ENV_DEFAULTS.items():
        if name not in os.environ:
            os.environ[name] = value
            undo.env_set.append(name)
    torch.use_deterministic_algorithms(True)
    return undo


def restore(undo: Undo) -> None:
    """Undo :func:`enable`: the variables it set, and torch's previous mode."""
    for name in undo.env_set:
        os.environ.pop(name, None)
    mode, warn_only = undo.torch_mode
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)


__all__ = ["ACCEPTED_NCCL_ALGOS", "ACCEPTED_VALUES", "ENV_DEFAULTS", "REQUIRED_MODEL_VALUES",
           "Undo", "check_environment", "enable", "restore"]
