"""Recipe loading: a YAML file in Megatron-Bridge style plus Hydra-style ``key=value`` overrides.

A recipe has the sections ``model``, ``train``, ``optimizer``, ``scheduler``, ``dataset``,
``checkpoint``, ``logger``, ``ddp`` and ``dist``. ``model`` holds TransformerConfig field names
(including the MSA ``msa_*`` fields of the project's config subclass) plus the few GPTModel
arguments (``vocab_size``, ``seq_length``, ...); ``optimizer`` holds OptimizerConfig field names;
``ddp`` holds DistributedDataParallelConfig field names. The other sections are described by the
dataclasses below. Every key is checked against its section before anything is built, so a typo
fails at once with the list of valid keys instead of being silently ignored, and every value
against the type of its field (the dataclass annotation: ours, TransformerConfig's,
OptimizerConfig's, DistributedDataParallelConfig's) and the range the loop needs, so that
``train.train_iters=3.5`` or ``optimizer.lr=abc`` is one ``RecipeError`` naming the key, the
value and the expected type instead of a traceback from deep inside Megatron or torch.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import enum
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import torch
import torch.nn.functional as F
import yaml
from omegaconf import OmegaConf

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "msa_tiny.yaml"


class RecipeError(ValueError):
    """A recipe or an override is invalid; the message names the key, value and expectation."""


#: YAML spellings of torch dtypes (config fields typed ``torch.dtype``).
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
}
#: YAML spellings of ``model.activation_func``.
ACTIVATIONS = ("gelu", "silu", "relu", "squared_relu", "quick_gelu")


def _activation(name: str):
    from megatron.core import activations

    return {"gelu": F.gelu, "silu": F.silu, "relu": F.relu,
            "squared_relu": activations.squared_relu,
            "quick_gelu": activations.quick_gelu}[name]


class _Mismatch(Exception):
    """A value does not fit a type hint (internal; turned into a RecipeError)."""


def _describe_type(hint: Any) -> str:
    """A reader's name for a type hint: 'an integer', 'null or a number', ..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "null"
    if origin is Union or isinstance(hint, types.UnionType):
        names = [_describe_type(a) for a in args if a is not type(None)]
        if type(None) in args:
            names.insert(0, "null")
        return " or ".join(dict.fromkeys(names))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is bool:
        return "true or false (bool)"
    if hint is int:
        return "an integer (int)"
    if hint is float:
        return "a number (float)"
    if hint is str:
        return "a string"
    if hint is list or origin is list:
        return f"a list of {_describe_type(args[0])} items" if args else "a list"
    if hint is tuple or origin is tuple:
        return "a list"
    if hint is dict or origin is dict:
        return "a mapping"
    if hint is torch.dtype:
        return "a dtype name (" + ", ".join(DTYPES) + ")"
    if hint is collections.abc.Callable or origin is collections.abc.Callable:
        return "null (a Python callable cannot be set from a recipe)"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(m) for m in hint.__members__)
    return getattr(hint, "__name__", repr(hint))


def _coerce(value: Any, hint: Any, key: str, convert: bool = True) -> Any:
    """``value`` as the type ``hint`` asks for, or raise _Mismatch.

    With ``convert``, integral floats become ints (``1e3`` for an iteration count), ints become
    floats and numbers become strings for string fields; a union first looks for a member the
    value already is (so ``3`` stays an int in ``str | int``). Dtype names, activation names and
    enum member names become the objects they name. Unknown typing constructs accept anything.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return value
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin is Union or isinstance(hint, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise _Mismatch
        for attempt in ((False, True) if convert else (False,)):
            for arg in args:
                if arg is type(None):
                    continue
                try:
                    return _coerce(value, arg, key, attempt)
                except _Mismatch:
                    continue
        raise _Mismatch
    if origin is Literal:
        for arg in args:
            if value == arg and type(value) is type(arg):
                return value
        raise _Mismatch
    if value is None:
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if (convert and isinstance(value, float) and math.isfinite(value)
                and value.is_integer()):
            return int(value)
        raise _Mismatch
    if hint is float:
        if isinstance(value, float) or (convert and number):
            return float(value)
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        if convert and number:
            return str(value)
        raise _Mismatch
    if hint is list or origin is list or hint is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise _Mismatch
            return tuple(_coerce(v, a, key, convert) for v, a in zip(value, args, strict=True))
        item = args[0] if args else Any
        items = [_coerce(v, item, key, convert) for v in value]
        return tuple(items) if (hint is tuple or origin is tuple) else items
    if hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise _Mismatch
    if hint is torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value in DTYPES:
            return DTYPES[value]
        raise _Mismatch
    if hint is collections.abc.Callable or origin is collections.abc.Callable:
        if key.endswith("activation_func") and isinstance(value, str) and value in ACTIVATIONS:
            return _activation(value)
        if callable(value):
            return value
        raise _Mismatch
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, hint):
            return value
        if isinstance(value, str) and value in hint.__members__:
            return hint[value]
        raise _Mismatch
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Mismatch
    check = origin if isinstance(origin, type) else None
    if check is not None and not isinstance(value, check):
        raise _Mismatch
    return value


def _expected(key: str, hint: Any) -> str:
    if key.endswith("activation_func"):
        return "one of " + ", ".join(repr(a) for a in ACTIVATIONS)
    return _describe_type(hint)


def coerce_value(section: str, key: str, value: Any) -> Any:
    """Check one recipe value against its field's type and return it as that type.

    Raises:
        RecipeError: ``recipe key 'section.key' = value: expected <type>, got <type>``.
    """
    hint = section_types(section).get(key, Any)
    try:
        return _coerce(value, hint, key)
    except _Mismatch:
        got = "null" if value is None else type(value).__name__
        raise RecipeError(f"recipe key '{section}.{key}' = {value!r}: expected "
                          f"{_expected(key, hint)}, got {got}") from None


def config_values(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """A section's values as the objects its config class takes (dtypes, activations, enums)."""
    return {key: coerce_value(section, key, value) for key, value in values.items()}


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
    num_workers: int = 0
    mmap_bin_files: bool = True


@dataclass
class CheckpointConfig:
    """Checkpoint settings (names follow Megatron-Bridge's CheckpointConfig)."""

    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    #: Resume from ``load`` (or ``save`` when load is null) if a finished checkpoint exists.
    resume: bool = True
    #: Keep at most this many finished checkpoints (null keeps all).
    keep_last: int | None = None
    #: Check the checkpoint's files against the size + SHA-256 manifest written at save before
    #: resuming (one extra read of the checkpoint). False also loads checkpoints without one.
    verify: bool = True
    #: When the newest checkpoint is damaged or the pointer file is missing/unreadable, resume
    #: from the newest intact checkpoint (with a warning) instead of stopping with an error.
    fallback: bool = False


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
    try:
        from nemo_msa.megatron.config import MSATransformerConfig

        return MSATransformerConfig
    except ImportError:
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig


def _section_keys(name: str) -> list[str]:
    if name == "model":
        cfg_fields = {f.name for f in dataclasses.fields(transformer_config_class()) if f.init}
        return sorted(cfg_fields | {f.name for f in dataclasses.fields(GPTModelArgs)})
    if name == "optimizer":
        from megatron.core.optimizer import OptimizerConfig

        return sorted(f.name for f in dataclasses.fields(OptimizerConfig) if f.init)
    if name == "ddp":
        from megatron.core.distributed import DistributedDataParallelConfig

        return sorted(f.name for f in dataclasses.fields(DistributedDataParallelConfig) if f.init)
    return sorted(f.name for f in dataclasses.fields(SECTION_DATACLASSES[name]))


_TYPES_CACHE: dict[str, dict[str, Any]] = {}


def section_types(name: str) -> dict[str, Any]:
    """``{key: type hint}`` of a recipe section, from its dataclass annotations."""
    if name not in _TYPES_CACHE:
        if name == "model":
            cls = transformer_config_class()
            hints = {f.name: typing.get_type_hints(cls).get(f.name, Any)
                     for f in dataclasses.fields(cls) if f.init}
            hints.update(typing.get_type_hints(GPTModelArgs))
        elif name == "optimizer":
            from megatron.core.optimizer import OptimizerConfig

            hints = typing.get_type_hints(OptimizerConfig)
        elif name == "ddp":
            from megatron.core.distributed import DistributedDataParallelConfig

            hints = typing.get_type_hints(DistributedDataParallelConfig)
        else:
            hints = typing.get_type_hints(SECTION_DATACLASSES[name])
        _TYPES_CACHE[name] = hints
    return _TYPES_CACHE[name]


_BACKING_CLASS = {"model": "TransformerConfig (megatron.core.transformer)",
                  "optimizer": "OptimizerConfig (megatron.core.optimizer)",
                  "ddp": "DistributedDataParallelConfig (megatron.core.distributed)"}


def _unknown_key_error(section: str, key: str, valid: list[str]) -> RecipeError:
    close = difflib.get_close_matches(key, valid, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    if section in _BACKING_CLASS:
        # Hundreds of Megatron fields would bury the message: name ours, point at the class.
        ours = [k for k in valid if k.startswith("msa_")] if section == "model" else []
        if section == "model":
            ours += [f.name for f in dataclasses.fields(GPTModelArgs)]
        shown = (", ".join(ours) + ", and " if ours else "") + (
            f"every field of {_BACKING_CLASS[section]}")
    else:
        shown = ", ".join(valid)
    return RecipeError(
        f"recipe key '{section}.{key}' is unknown.{hint} Valid keys of section '{section}': "
        f"{shown}"
    )


def parse_overrides(overrides: list[str]) -> Any:
    """Turn Hydra-style ``section.key=value`` strings into an OmegaConf node.

    Values are parsed as YAML (``3``, ``1e-3``, ``true``, ``null``, ``[a, b]``). A leading ``+``
    (Hydra's "add a key") is accepted and ignored, since every valid key may be set.
    """
    cleaned = []
    for item in overrides:
        if "=" not in item:
            raise RecipeError(
                f"override {item!r} is not of the form section.key=value "
                "(e.g. train.train_iters=50)"
            )
        key = item.split("=", 1)[0].lstrip("+")
        if "." not in key:
            raise RecipeError(
                f"override {item!r}: the key {key!r} must name a section and a field, "
                f"e.g. train.train_iters=50; sections: {', '.join(SECTIONS)}"
            )
        cleaned.append(item.lstrip("+"))
        try:
            OmegaConf.from_dotlist([cleaned[-1]])
        except yaml.YAMLError as err:
            raise RecipeError(f"override {item!r}: the value is not valid YAML "
                              f"({_yaml_problem(err)})") from None
    return OmegaConf.from_dotlist(cleaned)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML error: what is wrong and where."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{context + ': ' if context else ''}{problem}{where}"


def load_recipe(path: str | os.PathLike | None = None,
                overrides: list[str] | None = None) -> Recipe:
    """Load, merge and validate a recipe.

    Args:
        path: YAML recipe; None loads the embedded default ``recipes/msa_tiny.yaml``.
        overrides: ``section.key=value`` strings applied after the file.

    Returns:
        The validated Recipe.

    Raises:
        RecipeError: missing file, unknown section or key, wrong type of a section value.
    """
    path = Path(path) if path is not None else DEFAULT_RECIPE
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist (expected a YAML file)")
    try:
        base = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise RecipeError(f"recipe file {str(path)!r} is not valid YAML: "
                          f"{_yaml_problem(err)}") from None
    if not isinstance(base, dict) and not OmegaConf.is_dict(base):
        raise RecipeError(f"recipe {str(path)!r} must be a mapping of sections, got a list")
    merged = OmegaConf.merge(base, parse_overrides(list(overrides or [])))
    raw = OmegaConf.to_container(merged, resolve=True)
    return validate_recipe(raw, source=str(path))


def validate_recipe(raw: dict[str, Any], source: str = "<dict>") -> Recipe:
    """Check every section and key of a plain-dict recipe and build the Recipe."""
    for section in raw:
        if section not in SECTIONS:
            close = difflib.get_close_matches(str(section), SECTIONS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise RecipeError(
                f"recipe section '{section}' is unknown.{hint} Valid sections: "
                f"{', '.join(SECTIONS)}"
            )
    values: dict[str, Any] = {}
    for section in SECTIONS:
        body = raw.get(section) or {}
        if not isinstance(body, dict):
            raise RecipeError(
                f"recipe section '{section}' must be a mapping of key: value, got {body!r}"
            )
        valid = _section_keys(section)
        for key in body:
            if key not in valid:
                raise _unknown_key_error(section, str(key), valid)
        values[section] = {}
        for key, value in body.items():
            typed = coerce_value(section, key, value)
            # Plain values are stored typed (3.0 -> 3 for an int); objects that a name stands
            # for (dtypes, activations, enums) keep their YAML name until the config is built.
            values[section][key] = typed if isinstance(typed, _PLAIN) else value

    gpt_names = {f.name for f in dataclasses.fields(GPTModelArgs)}
    model = {k: v for k, v in values["model"].items() if k not in gpt_names}
    gpt = GPTModelArgs(**{k: v for k, v in values["model"].items() if k in gpt_names})
    # The rope settings are both GPTModel arguments and (in newer cores) config fields; keep
    # them on the config too when the config class knows them, so the two never disagree.
    cfg_fields = {f.name for f in dataclasses.fields(transformer_config_class())}
    for name in gpt_names & cfg_fields:
        model[name] = getattr(gpt, name)
    recipe = Recipe(
        model=model,
        gpt=gpt,
        optimizer=values["optimizer"],
        ddp=values["ddp"],
        source=source,
        resolved=raw,
        **{name: cls(**values[name]) for name, cls in SECTION_DATACLASSES.items()},
    )
    _check_values(recipe)
    return recipe


_PLAIN = (bool, int, float, str, list, dict, type(None))

#: Ranges of numeric keys: (lowest, lowest included, highest, highest included); null passes.
_RANGES: dict[str, tuple[float | None, bool, float | None, bool]] = {
    "train.seed": (0, True, None, False),
    "train.exit_interval": (0, False, None, False),
    "scheduler.lr_warmup_init": (0, True, None, False),
    "scheduler.lr_decay_iters": (0, False, None, False),
    "scheduler.lr_wsd_decay_iters": (0, True, None, False),
    "scheduler.start_weight_decay": (0, True, None, False),
    "scheduler.end_weight_decay": (0, True, None, False),
    "dataset.num_workers": (0, True, None, False),
    "checkpoint.keep_last": (0, False, None, False),
    "dist.timeout_minutes": (0, False, None, False),
    "model.vocab_size": (0, False, None, False),
    "model.make_vocab_size_divisible_by": (0, False, None, False),
    "model.rotary_percent": (0, False, 1, True),
    "model.rotary_base": (0, False, None, False),
    "model.num_layers": (0, False, None, False),
    "model.hidden_size": (0, False, None, False),
    "model.num_attention_heads": (0, False, None, False),
    "model.num_query_groups": (0, False, None, False),
    "model.kv_channels": (0, False, None, False),
    "model.ffn_hidden_size": (0, False, None, False),
    "model.hidden_dropout": (0, True, 1, False),
    "model.attention_dropout": (0, True, 1, False),
    "model.tensor_model_parallel_size": (1, True, None, False),
    "model.pipeline_model_parallel_size": (1, True, None, False),
    "model.context_parallel_size": (1, True, None, False),
    "optimizer.lr": (0, True, None, False),
    "optimizer.min_lr": (0, True, None, False),
    "optimizer.weight_decay": (0, True, None, False),
    "optimizer.adam_beta1": (0, True, 1, False),
    "optimizer.adam_beta2": (0, True, 1, False),
    "optimizer.adam_eps": (0, False, None, False),
    "optimizer.clip_grad": (0, True, None, False),
    "optimizer.sgd_momentum": (0, True, 1, False),
}


def _check_ranges(r: Recipe) -> None:
    sections = {"model": {**r.model, **dataclasses.asdict(r.gpt)}, "optimizer": r.optimizer}
    for name in SECTION_DATACLASSES:
        sections[name] = dataclasses.asdict(getattr(r, name))
    for key, (low, low_in, high, high_in) in _RANGES.items():
        section, name = key.split(".", 1)
        value = sections[section].get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        ok = math.isfinite(value)
        ok = ok and (low is None or value > low or (low_in and value == low))
        ok = ok and (high is None or value < high or (high_in and value == high))
        if not ok:
            lo = "" if low is None else f"{low} {'<=' if low_in else '<'} "
            hi = "" if high is None else f" {'<=' if high_in else '<'} {high}"
            _require(False, key, value, f"{lo}value{hi}")


#: ``dataset.split``: up to three weights (train, valid, test) separated by ',' or '/'.
_SPLIT_ITEM = re.compile(r"\s*(\d+(\.\d*)?|\.\d+)\s*")


def parse_split(split: str) -> list[float]:
    """Parse ``dataset.split`` ('99,1,0' or '99/1/0') into three non-negative weights.

    Raises:
        RecipeError: not one to three non-negative numbers, or no weight on the training split.
    """
    parts = re.split(r"[,/]", str(split))
    expected = ("one to three non-negative numbers for train, valid, test separated by ',' "
                "(e.g. '99,1,0') with a positive first one")
    if not 1 <= len(parts) <= 3 or not all(_SPLIT_ITEM.fullmatch(p) for p in parts):
        _require(False, "dataset.split", split, expected)
    weights = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    _require(weights[0] > 0, "dataset.split", split, expected)
    return weights


def _require(cond: bool, key: str, value: Any, expectation: str) -> None:
    if not cond:
        raise RecipeError(f"recipe key '{key}' = {value!r}: expected {expectation}")


def _check_values(r: Recipe) -> None:
    _check_ranges(r)
    t = r.train
    parse_split(r.dataset.split)
    if r.dataset.eod_id is not None:
        _require(0 <= r.dataset.eod_id < r.gpt.vocab_size, "dataset.eod_id", r.dataset.eod_id,
                 f"a token id inside the vocabulary, 0 <= id < model.vocab_size "
                 f"({r.gpt.vocab_size})")
    _require(t.train_iters > 0, "train.train_iters", t.train_iters, "a positive integer")
    _require(t.micro_batch_size > 0, "train.micro_batch_size", t.micro_batch_size, "> 0")
    _require(t.global_batch_size > 0 and t.global_batch_size % t.micro_batch_size == 0,
             "train.global_batch_size", t.global_batch_size,
             f"a positive multiple of train.micro_batch_size ({t.micro_batch_size})")
    _require(r.gpt.seq_length > 0, "model.seq_length", r.gpt.seq_length, "a positive integer")
    impl = r.model.setdefault("transformer_impl", "local")
    _require(impl in ("local", "transformer_engine"), "model.transformer_impl", impl,
             "'local' (torch modules) or 'transformer_engine'")
    _require(r.dist.backend in ("auto", "nccl", "gloo"), "dist.backend", r.dist.backend,
             "'auto', 'nccl' or 'gloo'")
    _require(r.logger.log_interval > 0, "logger.log_interval", r.logger.log_interval, "> 0")
    decay = r.scheduler.lr_decay_iters or t.train_iters
    _require(0 <= r.scheduler.lr_warmup_iters < decay, "scheduler.lr_warmup_iters",
             r.scheduler.lr_warmup_iters,
             f"0 <= value < scheduler.lr_decay_iters (or train.train_iters) = {decay}")
    lr, min_lr = r.optimizer.get("lr"), r.optimizer.get("min_lr")
    if lr is not None and min_lr is not None:
        _require(float(min_lr) <= float(lr), "optimizer.min_lr", min_lr,
                 f"<= optimizer.lr ({lr})")
    sch = r.scheduler
    _require(not (sch.override_opt_param_scheduler and sch.use_checkpoint_opt_param_scheduler),
             "scheduler.use_checkpoint_opt_param_scheduler", True,
             "false when scheduler.override_opt_param_scheduler is true (pick one)")
    c = r.checkpoint
    if c.save_interval is not None:
        _require(c.save_interval > 0, "checkpoint.save_interval", c.save_interval, "> 0 or null")
        _require(c.save is not None, "checkpoint.save", c.save,
                 "a directory when checkpoint.save_interval is set")
    _require(r.scheduler.lr_decay_style in ("constant", "linear", "cosine", "inverse-square-root",
                                            "WSD"),
             "scheduler.lr_decay_style", r.scheduler.lr_decay_style,
             "one of constant, linear, cosine, inverse-square-root, WSD")


def check_parallel_layout(model: dict[str, Any], world_size: int, global_batch_size: int,
                          micro_batch_size: int, num_layers: int) -> int:
    """Check that the parallel layout fits the world size; return the data-parallel size.

    Raises:
        RecipeError: naming the sizes when TP*PP*CP does not divide the world size, when the
            layers do not split evenly over the pipeline (virtual) stages, or when the global
            batch is not a multiple of micro batch * data parallel.
    """
    tp = int(model.get("tensor_model_parallel_size", 1) or 1)
    pp = int(model.get("pipeline_model_parallel_size", 1) or 1)
    cp = int(model.get("context_parallel_size", 1) or 1)
    vpp = model.get("virtual_pipeline_model_parallel_size")
    mp = tp * pp * cp
    if world_size % mp != 0:
        raise RecipeError(
            f"parallel layout does not divide the world size: tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp} x context_parallel_size={cp} = {mp}, but the "
            f"world size is {world_size} (expected a multiple of {mp}; launch with "
            f"torchrun --nproc-per-node {mp} or change model.*_parallel_size)"
        )
    dp = world_size // mp
    chunks = pp * (int(vpp) if vpp else 1)
    if vpp is not None:
        _require(int(vpp) >= 2 and pp >= 2, "model.virtual_pipeline_model_parallel_size", vpp,
                 "null, or >= 2 together with pipeline_model_parallel_size >= 2")
    if num_layers % chunks != 0:
        raise RecipeError(
            f"recipe key 'model.num_layers' = {num_layers}: expected a multiple of "
            f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {chunks}"
        )
    if global_batch_size % (micro_batch_size * dp) != 0:
        raise RecipeError(
            f"recipe key 'train.global_batch_size' = {global_batch_size}: expected a multiple of "
            f"micro_batch_size x data-parallel size = {micro_batch_size} x {dp}"
        )
    if vpp is not None:
        nmb = global_batch_size // (micro_batch_size * dp)
        _require(nmb % pp == 0, "train.global_batch_size", global_batch_size,
                 f"a number of microbatches ({nmb}) that is a multiple of "
                 f"pipeline_model_parallel_size ({pp}) for the interleaved schedule")
    return dp
