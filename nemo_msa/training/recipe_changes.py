"""What a resume changes: the recipe keys that differ from the recipe a checkpoint was saved with.

Every checkpoint carries the recipe that wrote it (``recipe`` in its common state). On resume
:func:`check_recipe_changes` lists, in one block on stderr, every key whose value differs (a key
set on one side only is compared with its default), and refuses the keys that change the model
or the data order unless ``checkpoint.allow_recipe_change=true`` (ADR 0049):

- **the model**: every ``model`` key except :data:`FREE_MODEL_KEYS` (the parallel layout,
  recompute, precision, the MSA backend, the TE/local implementation and the deterministic
  mode, which a checkpoint reloads across with the same function). Unclassified Megatron fields
  count as the model's: a new field is guarded until it is known to be harmless.
- **the data order**: :data:`DATA_ORDER_KEYS` (the seed, the batch sizes, the corpus, its split
  and its document boundaries).

The other keys (``train.train_iters``, the optimizer and schedule, evaluation, ``ddp``) are
listed and allowed; a changed schedule still meets ADR 0011's check. ``checkpoint``, ``logger``
and ``dist`` say where and how a run reports, not what it trains: they are not compared.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from nemo_msa.training.recipe_fields import RecipeError
from nemo_msa.training.recipe_schema import (
    SECTION_DATACLASSES,
    SECTIONS,
    GPTModelArgs,
    coerce_value,
    transformer_config_class,
)

#: ``model`` keys a resume may change: they change neither the parameters' shapes, nor the
#: function the model computes (beyond the rounding of another precision or layout), nor the
#: data order. Checkpoints reshard across the parallel layout, recompute gives the same
#: gradients bit for bit (ADR 0028), the backends compute one function (ADR 0002), and the TE
#: and local specs load each other's checkpoints (ADR 0036).
FREE_MODEL_KEYS = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "context_parallel_size", "sequence_parallel",
    "expert_model_parallel_size", "expert_tensor_parallel_size",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "msa_backend", "transformer_impl", "deterministic_mode",
    "bf16", "fp16", "params_dtype", "pipeline_dtype",
    "fp8", "fp8_recipe", "fp8_param", "fp8_margin", "fp8_amax_history_len",
    "fp8_amax_compute_algo",
})
#: Keys outside ``model`` that change the data order (or which tokens count), with why.
DATA_ORDER_KEYS: dict[str, str] = {
    "train.seed": "the data order and the random streams",
    "train.global_batch_size": "the samples of every step",
    "train.micro_batch_size": "how a step's loss is averaged over its microbatches",
    "dataset.data_path": "the corpus",
    "dataset.split": "which documents train",
    "dataset.eod_id": "the document boundaries",
    "dataset.reset_position_ids": "the token positions",
    "dataset.eod_mask_loss": "which tokens the loss counts",
}
#: Sections that say where and how a run reports, never what it trains: not compared.
UNCOMPARED_SECTIONS = ("checkpoint", "logger", "dist")
#: Values shown as their field's type; others (dtypes, activations) as the recipe names them.
_PLAIN = (bool, int, float, str, list, dict, type(None))
#: Defaults the recipe applies where the config class has another (recipe._check_values).
_RECIPE_DEFAULTS: dict[str, Any] = {"model.transformer_impl": "local"}


@dataclass(frozen=True)
class Difference:
    """One recipe key whose value differs from the checkpoint's recipe."""

    #: ``section.key``.
    key: str
    #: The value in the checkpoint's recipe (its default where that recipe does not set it).
    saved: Any
    #: This run's value (likewise).
    now: Any
    #: Why a resume must not change it without ``checkpoint.allow_recipe_change`` (None: free).
    guarded: str | None


def _section_classes(section: str) -> tuple[type, ...]:
    if section == "model":
        return (transformer_config_class(), GPTModelArgs)
    if section == "optimizer":
        return (OptimizerConfig,)
    if section == "ddp":
        return (DistributedDataParallelConfig,)
    return (SECTION_DATACLASSES[section],)


def _default(section: str, key: str) -> Any:
    """The value a key takes when a recipe does not set it (None where there is none)."""
    if f"{section}.{key}" in _RECIPE_DEFAULTS:
        return _RECIPE_DEFAULTS[f"{section}.{key}"]
    for cls in reversed(_section_classes(section)):
        for f in dataclasses.fields(cls):
            if f.name == key:
                if f.default is not dataclasses.MISSING:
                    return f.default
                if f.default_factory is not dataclasses.MISSING:
                    return f.default_factory()
                return None
    return None


def _comparable(section: str, key: str, value: Any) -> Any:
    """The value as its field's type (``1e3`` and ``1000`` compare equal; names of dtypes and
    activations as the objects they name); as given where the key is unknown here."""
    try:
        return coerce_value(section, key, value)
    except RecipeError:
        return value


def _guard(key: str) -> str | None:
    section, name = key.split(".", 1)
    if section == "model":
        return None if name in FREE_MODEL_KEYS else "changes the model"
    why = DATA_ORDER_KEYS.get(key)
    return f"changes the data order ({why})" if why else None


def differences(saved: dict | None, current: dict | None) -> list[Difference]:
    """The keys of the compared sections whose values differ, in section order.

    Args:
        saved: the checkpoint's recipe (as resolved when it was saved: section -> key -> value).
        current: this run's resolved recipe.

    Returns:
        One :class:`Difference` per key, sorted by section (as in :data:`SECTIONS`) and key.
    """
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return []
    found = []
    for section in SECTIONS:
        if section in UNCOMPARED_SECTIONS:
            continue
        a, b = saved.get(section) or {}, current.get(section) or {}
        if not isinstance(a, dict) or not isinstance(b, dict):
            continue
        for key in sorted(set(a) | set(b)):
            was = a[key] if key in a else _default(section, key)
            now = b[key] if key in b else _default(section, key)
            typed_was, typed_now = _comparable(section, key, was), _comparable(section, key, now)
            if typed_was != typed_now:
                # Shown as typed (100, not 1e2's 100.0); names of objects as written.
                found.append(Difference(
                    f"{section}.{key}", typed_was if isinstance(typed_was, _PLAIN) else was,
                    typed_now if isinstance(typed_now, _PLAIN) else now,
                    _guard(f"{section}.{key}")))
    return found


def format_block(found: list[Difference], path: Path, enforced: bool, allowed: bool) -> str:
    """The block printed on resume: one line per changed key, the guarded ones marked."""
    plural = "s" if len(found) != 1 else ""
    lines = [f"recipe changes since checkpoint {path} ({len(found)} key{plural}):"]
    for d in found:
        mark = ""
        if d.guarded and enforced:
            mark = (f"  [{d.guarded}: allowed by checkpoint.allow_recipe_change=true]" if allowed
                    else f"  [{d.guarded}: refused without checkpoint.allow_recipe_change=true]")
        elif d.guarded:
            mark = f"  [{d.guarded}]"
        lines.append(f"  {d.key}: {d.saved!r} -> {d.now!r}{mark}")
    return "\n".join(lines)


def check_recipe_changes(saved: dict | None, current: dict, path: Path, *, training: bool,
                         allowed: bool, rank: int = 0) -> list[Difference]:
    """List what differs from the checkpoint's recipe (rank 0 prints it); refuse guarded keys.

    Args:
        saved: the checkpoint's recipe (None or empty: a checkpoint without one, nothing to do).
        current: this run's resolved recipe.
        path: the checkpoint (named in the block and the error).
        training: the run trains on from the checkpoint (false: it only evaluates it,
            ``train.skip_train``, and nothing is refused).
        allowed: ``checkpoint.allow_recipe_change``.
        rank: this process's rank (only rank 0 prints).

    Returns:
        The differences.

    Raises:
        RecipeError: a key that changes the model or the data order differs, the run trains
            and ``allowed`` is false; names the keys, both values and the flag.
    """
    found = differences(saved, current)
    if not found:
        return found
    if rank == 0:
        print(format_block(found, path, training, allowed), file=sys.stderr, flush=True)
    refused = [d for d in found if d.guarded] if training and not allowed else []
    if len(refused) == 1:
        d = refused[0]
        raise RecipeError(
            f"recipe key '{d.key}' = {d.now!r} differs from the recipe checkpoint {path} was "
            f"saved with ({d.saved!r}) and {d.guarded}: resume with the checkpoint's value, or "
            "pass checkpoint.allow_recipe_change=true to train on with this recipe")
    if refused:
        keys = ", ".join(f"'{d.key}' = {d.now!r} (checkpoint: {d.saved!r})" for d in refused)
        raise RecipeError(
            f"recipe keys {keys} differ from the recipe checkpoint {path} was saved with and "
            "change the model or the data order: resume with the checkpoint's values, or pass "
            "checkpoint.allow_recipe_change=true to train on with this recipe")
    return found


__all__ = ["DATA_ORDER_KEYS", "FREE_MODEL_KEYS", "UNCOMPARED_SECTIONS", "Difference",
           "check_recipe_changes", "differences", "format_block"]
