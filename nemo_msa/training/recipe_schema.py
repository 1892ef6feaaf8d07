"""The sections of a recipe and the keys each one takes, with their types.

A recipe has the sections ``model``, ``train``, ``optimizer``, ``scheduler``, ``dataset``,
``checkpoint``, ``logger``, ``ddp`` and ``dist``. ``model`` holds TransformerConfig field names
(including the MSA ``msa_*`` fields of the project's config subclass) plus the few GPTModel
arguments (:class:`GPTModelArgs`); ``optimizer`` holds OptimizerConfig field names; ``ddp``
holds DistributedDataParallelConfig field names. The other sections are the dataclasses below.
:func:`section_schema` gives every section's keys and their type hints from the dataclass
annotations (ours or Megatron's), which is what a recipe is checked against.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass, field
from typing import Any

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from nemo_msa.training.recipe_fields import RecipeError, check_field


@dataclass
class GPTModelArgs:
    """GPTModel constructor arguments that are not TransformerConfig fields."""

    vocab_size: int = 1024
    seq_length: int = 1024
    make_vocab_size_divisible_by: int = 128
    share_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "rope"
    rotary_percent: float = 1.0
    rotary_base: int = 10000


@dataclass
class TrainConfig:
    """Training-loop settings (names follow Megatron-Bridge's TrainingConfig)."""

    train_iters: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 1
    seed: int = 1234
    #: Stop after this many iterations of *this* run (the schedule still spans train_iters);
    #: lets tests and operators interrupt a run at a known step without changing the curve.
    exit_interval: int | None = None
    #: During the MSA dense warm-up (model.msa_dense_warmup_steps) only the indexer learns, as
    #: the MiniMax-M3 recipe prescribes; false also trains the rest of the model then (useful
    #: when training from scratch, where a frozen random model gives the indexer little to learn).
    freeze_main_during_warmup: bool = True
    #: Evaluate on the validation split of ``dataset.split`` every this many steps and after the
    #: run's last step (null: no evaluation), as Megatron's --eval-interval.
    eval_interval: int | None = None
    #: Global batches of validation data per evaluation (Megatron's --eval-iters).
    eval_iters: int = 10
    #: A token id that marks a copy document (``marker, text, marker, text``, as
    #: scripts/prepare_corpus.py --copy-fraction writes them): the evaluation also reports
    #: ``val_loss/copy``, the loss of the tokens that follow their document's second marker,
    #: which only an attention that reaches back to the first copy predicts. Null: not reported.
    eval_copy_marker: int | None = None
    #: Retrieval probes run at every evaluation (ADR 0040, :mod:`nemo_msa.training.probes`):
    #: ``passkey`` (a random key planted at a depth of held-out text and asked for at the end;
    #: accuracy and loss of the key's tokens per depth bucket) and ``mqar`` (multi-query
    #: associative recall; accuracy and loss of the values per query-pair distance bucket).
    #: Needs ``train.eval_interval``. Empty: no probes.
    eval_probes: list[str] = field(default_factory=list)
    #: Passkey rows per depth bucket (5 buckets), and MQAR rows.
    eval_probe_rows: int = 8
    #: Seed of the probes' random draws (keys, values, depths, query order).
    eval_probe_seed: int = 0
    #: Tokens of the passkey key.
    eval_probe_key_length: int = 8
    #: Key-value pairs (and queries) per MQAR row, at most seq_length // 4 // 5 (null: 16, or
    #: as many as fit).
    eval_probe_mqar_pairs: int | None = None
    #: ``[passkey marker, MQAR marker]`` token ids, removed from the held-out text of the probes
    #: (bytes 1 and 2 by default: control characters that Python source does not hold; the same
    #: as ``scripts/prepare_corpus.py --passkey-fraction / --mqar-fraction`` plant).
    eval_probe_markers: list[int] = field(default_factory=lambda: [1, 2])
    #: ``[lo, hi]``: key and value tokens are drawn from ``lo <= id < hi`` (default: the bytes of
    #: 'A'..'Z', as prepare_corpus.py draws them).
    eval_probe_token_range: list[int] = field(default_factory=lambda: [65, 91])
    #: Run no training step: evaluate the loaded (or fresh) model once at its iteration and exit
    #: (Megatron's --skip-train); with ``checkpoint.load`` and another ``model.seq_length`` it
    #: evaluates a model at a length it was not trained at (length extrapolation, ADR 0040).
    skip_train: bool = False
    #: Stop this run (final evaluation and checkpoint included) after the first step that ends
    #: this many minutes after the first step began (Megatron's --exit-duration-in-mins).
    exit_duration_in_mins: float | None = None


@dataclass
class SchedulerConfig:
    """Learning-rate and weight-decay schedule (OptimizerParamScheduler arguments)."""

    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_decay_iters: int | None = None
    lr_decay_style: str = "cosine"
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: int | None = None
    #: On resume, take the recipe's lr / min_lr / schedule over the checkpoint's (Megatron's
    #: --override-opt_param-scheduler). With both flags off a changed value is an error.
    override_opt_param_scheduler: bool = False
    #: On resume, keep the checkpoint's lr / min_lr / schedule whatever the recipe says.
    use_checkpoint_opt_param_scheduler: bool = False


#: ``dataset.packed_format`` values: ``bshd`` [b, S] rows with the document ids as the attention
#: mask; ``thd`` the rows end to end with Megatron's PackedSeqParams (ADR 0052).
PACKED_FORMATS = ("bshd", "thd")


@dataclass
class DatasetConfig:
    """Data settings: Megatron GPT datasets, mock or real indexed data."""

    #: Path prefixes of indexed datasets (``prefix.bin``/``prefix.idx``), optionally weighted
    #: as in Megatron (``[w1, prefix1, w2, prefix2]``). Empty or null: MockGPTDataset.
    data_path: list[Any] | str | None = None
    split: str = "99,1,0"
    #: Token id that ends a document; null means vocab_size - 1 (NullTokenizer convention).
    eod_id: int | None = None
    reset_position_ids: bool = True
    eod_mask_loss: bool = False
    path_to_cache: str | None = None
    mmap_bin_files: bool = True
    #: How a microbatch reaches the model: "bshd" ([b, S] rows, the document ids as
    #: attention_mask) or "thd" (the rows end to end as one pack, Megatron's PackedSeqParams with
    #: cu_seqlens at the same EOD boundaries). The two train the same function.
    packed_format: str = "bshd"


@dataclass
class CheckpointConfig:
    """Checkpoint settings (names follow Megatron-Bridge's CheckpointConfig)."""

    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    #: Resume from ``load`` (or ``save`` when load is null) if a finished checkpoint exists.
    resume: bool = True
    #: Allow a run to write into a ``save`` directory holding finished checkpoints it did not
    #: resume from (they would be overwritten); refused otherwise.
    overwrite: bool = False
    #: Keep at most this many finished checkpoints (null keeps all).
    keep_last: int | None = None
    #: Check the checkpoint's files against the size + SHA-256 manifest written at save before
    #: resuming (one extra read of the checkpoint). False also loads checkpoints without one.
    verify: bool = True
    #: When the newest checkpoint is damaged or the pointer file is missing/unreadable, resume
    #: from the newest intact checkpoint (with a warning) instead of stopping with an error.
    fallback: bool = False
    #: A lock of ``save`` held on another machine (host name, boot or pid namespace) whose
    #: heartbeat stopped this many seconds ago is taken over (ADR 0049); a holder on this
    #: machine is judged by its pid at once. The holder beats every min(30, this / 4) s. Null:
    #: a lock held elsewhere is never taken over.
    lock_stale_s: float | None = 120.0
    #: Resume although recipe keys that change the model or the data order differ from the
    #: checkpoint's recipe (they are listed either way; ADR 0049).
    allow_recipe_change: bool = False


@dataclass
class LoggerConfig:
    """Logging and user-facing output."""

    log_interval: int = 1
    progress_bar: bool = True
    #: Write loss_curve.png beside the checkpoint (or in ``output_dir``) at the end.
    plot: bool = True
    #: Where the metrics log, summary and plot go when no checkpoint directory is set.
    output_dir: str | None = "runs/latest"


@dataclass
class DistConfig:
    """Process-group settings."""

    #: "auto" picks nccl when CUDA is available, else gloo.
    backend: str = "auto"
    timeout_minutes: int = 10
    #: Run on the CPU even if CUDA is available (uses the project's CPU shim).
    force_cpu: bool = False


SECTION_DATACLASSES: dict[str, type] = {
    "train": TrainConfig,
    "scheduler": SchedulerConfig,
    "dataset": DatasetConfig,
    "checkpoint": CheckpointConfig,
    "logger": LoggerConfig,
    "dist": DistConfig,
}
SECTIONS = ("model", "train", "optimizer", "scheduler", "dataset", "checkpoint", "logger",
            "ddp", "dist")


@dataclass
class Recipe:
    """A validated recipe: plain dicts for the Megatron config sections, dataclasses for ours."""

    model: dict[str, Any]
    gpt: GPTModelArgs
    train: TrainConfig
    optimizer: dict[str, Any]
    scheduler: SchedulerConfig
    dataset: DatasetConfig
    checkpoint: CheckpointConfig
    logger: LoggerConfig
    ddp: dict[str, Any]
    dist: DistConfig
    source: str = ""
    #: The merged recipe as a plain dict, saved with every checkpoint for provenance.
    resolved: dict[str, Any] = field(default_factory=dict)


def transformer_config_class() -> type:
    """Return the TransformerConfig class the model section is validated against.

    The project's MSA config subclass when it is importable, else Megatron's TransformerConfig
    (the pipeline then builds a dense GPT, which the tests use as a reference).
    """
    # Imported here, not at the top: this module must still check recipes (against Megatron's
    # own config) when the MSA integration does not import.
    try:
        from nemo_msa.megatron.config import MSATransformerConfig

        return MSATransformerConfig
    except ImportError:
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig



@dataclass(frozen=True)
class SectionSchema:
    """The keys of one recipe section and the type hint of each."""

    name: str
    #: ``{key: type hint}``, from the annotations of the section's classes (init fields).
    types: dict[str, Any]
    #: The Megatron class behind the section, named in the unknown-key message (None: ours).
    backing: str | None = None

    @property
    def keys(self) -> list[str]:
        """The valid keys, sorted."""
        return sorted(self.types)


#: Sections whose keys are a Megatron config class's fields: (class, how the message names it).
_MEGATRON_SECTIONS: dict[str, tuple[type, str]] = {
    "optimizer": (OptimizerConfig, "OptimizerConfig (megatron.core.optimizer)"),
    "ddp": (DistributedDataParallelConfig,
            "DistributedDataParallelConfig (megatron.core.distributed)"),
}


def _field_types(*classes: type) -> dict[str, Any]:
    """``{field: type hint}`` of the init fields of dataclasses; a later class wins a name."""
    types: dict[str, Any] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        types.update({f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init})
    return types


@functools.cache
def section_schema(name: str) -> SectionSchema:
    """The keys and types of a recipe section (one of :data:`SECTIONS`)."""
    if name == "model":
        return SectionSchema(name, _field_types(transformer_config_class(), GPTModelArgs),
                             "TransformerConfig (megatron.core.transformer)")
    if name in _MEGATRON_SECTIONS:
        cls, backing = _MEGATRON_SECTIONS[name]
        return SectionSchema(name, _field_types(cls), backing)
    return SectionSchema(name, _field_types(SECTION_DATACLASSES[name]))


def unknown_key_error(section: str, key: str) -> RecipeError:
    """The error for a key that ``section`` does not have, with the closest valid keys."""
    schema = section_schema(section)
    valid = schema.keys
    close = difflib.get_close_matches(key, valid, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    if schema.backing is not None:
        # Hundreds of Megatron fields would bury the message: name ours, point at the class.
        ours = [k for k in valid if k.startswith("msa_")] if section == "model" else []
        if section == "model":
            ours += [f.name for f in dataclasses.fields(GPTModelArgs)]
        shown = (", ".join(ours) + ", and " if ours else "") + f"every field of {schema.backing}"
    else:
        shown = ", ".join(valid)
    return RecipeError(
        f"recipe key '{section}.{key}' is unknown.{hint} Valid keys of section '{section}': "
        f"{shown}"
    )


def coerce_value(section: str, key: str, value: Any) -> Any:
    """Check one recipe value against its field's type and return it as that type.

    Raises:
        RecipeError: ``recipe key 'section.key' = value: expected <type>, got <type>``.
    """
    return check_field(f"{section}.{key}", value, section_schema(section).types.get(key, Any))


def config_values(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """A section's values as the objects its config class takes (dtypes, activations, enums)."""
    return {key: coerce_value(section, key, value) for key, value in values.items()}


__all__ = ["PACKED_FORMATS", "SECTIONS", "SECTION_DATACLASSES", "CheckpointConfig",
           "DatasetConfig", "DistConfig", "GPTModelArgs", "LoggerConfig", "Recipe",
           "SchedulerConfig", "SectionSchema", "TrainConfig", "coerce_value", "config_values",
           "section_schema", "transformer_config_class", "unknown_key_error"]
