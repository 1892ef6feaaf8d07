"""Training phase of MSA layers: dense warm-up, then sparse.

During the first ``msa_dense_warmup_steps`` iterations MSA layers attend densely (within
documents) and the indexer learns from the dense attention through the indexer loss; afterwards
they attend the selected blocks. The loop tells the layers the iteration with
:func:`set_training_iteration` before each step (an explicit call rather than a counter inside
the layers, because microbatches, evaluation and restarts would make a counter wrong).

"Only the indexer learns" during the warm-up is an optimizer decision: use
:func:`set_main_parameters_trainable` (or exclude :func:`non_indexer_parameters` from the
optimizer step) for the warm-up iterations.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = [
    "dense_warmup_active",
    "get_training_iteration",
    "get_training_step_count",
    "indexer_parameters",
    "non_indexer_parameters",
    "set_main_parameters_trainable",
    "set_training_iteration",
]

_ITERATION: int | None = None
# How many times the iteration was set: a new step even when a failed one is retried.
_STEP_COUNT = 0


def set_training_iteration(iteration: int | None) -> None:
    """Tells every MSA layer of the process the current (0-based) training iteration.

    Call it once per step, before the step's first forward (not per microbatch): each call starts
    a new step, whose first act is to drop the selection-replay entries an earlier step left
    (nemo_msa.megatron.selection_replay), so a call between a forward and its backward makes
    that backward's recompute fail.

    Args:
        iteration: the iteration about to run, or None to forget it.

    Raises:
        ValueError: a negative iteration.
    """
    global _ITERATION, _STEP_COUNT
    if iteration is not None and (isinstance(iteration, bool) or int(iteration) < 0):
        raise ValueError(f"iteration={iteration!r}; expected an int >= 0 or None")
    _ITERATION = None if iteration is None else int(iteration)
    _STEP_COUNT += 1


def get_training_iteration() -> int | None:
    """The iteration set by :func:`set_training_iteration` (None if never set)."""
    return _ITERATION


def get_training_step_count() -> int:
    """How many times :func:`set_training_iteration` was called (0 if never): changes at every
    step of a loop that calls it, a retried iteration included."""
    return _STEP_COUNT


def dense_warmup_active(config) -> bool:
    """Whether MSA layers attend densely now.

    Raises:
        RuntimeError: ``msa_dense_warmup_steps > 0`` but the iteration was never set, which
            would otherwise skip the warm-up silently.
    """
    steps = int(getattr(config, "msa_dense_warmup_steps", 0) or 0)
    if steps == 0:
        return False
    if _ITERATION is None:
        raise RuntimeError(
            f"msa_dense_warmup_steps={steps} but the training iteration is unknown; call "
            "nemo_msa.megatron.set_training_iteration(iteration) before each step"
        )
    return _ITERATION < steps


def _is_indexer_parameter(name: str) -> bool:
    return ".indexer." in f".{name}"


def indexer_parameters(model: torch.nn.Module | Iterable[torch.nn.Module]) -> Iterator:
    """Yields the indexer parameters of a model (or of a list of model chunks)."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if _is_indexer_parameter(name):
                yield param


def non_indexer_parameters(model: torch.nn.Module | Iterable[torch.nn.Module]) -> Iterator:
    """Yields every parameter that is not part of an MSA indexer."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not _is_indexer_parameter(name):
                yield param


def set_main_parameters_trainable(
    model: torch.nn.Module | Iterable[torch.nn.Module], trainable: bool
) -> int:
    """Freezes (warm-up) or unfreezes every non-indexer parameter via ``requires_grad``.

    Call it before wrapping the model in DDP/optimizer for the warm-up, and again when the
    warm-up ends (Megatron's DDP allocates gradient buffers for the parameters that require a
    gradient at wrap time, so re-wrap or keep them trainable and skip their update instead).

    Returns:
        How many parameters changed.
    """
    changed = 0
    for param in non_indexer_parameters(model):
        if param.requires_grad != trainable:
            param.requires_grad_(trainable)
            changed += 1
    return changed
