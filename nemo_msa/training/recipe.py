"""Recipe loading: a YAML file in Megatron-Bridge style plus Hydra-style ``key=value`` overrides.

:func:`load_recipe` reads the file (the embedded ``recipes/msa_tiny.yaml`` by default), applies
the overrides and validates the result (:func:`validate_recipe`): every key is checked against
its section (:mod:`nemo_msa.training.recipe_schema`) before anything is built, so a typo fails
at once with the list of valid keys instead of being silently ignored; every value against the
type of its field (:mod:`nemo_msa.training.recipe_fields`); then the ranges and cross-key rules
the loop needs. :func:`check_parallel_layout` checks the layout against the world size, which
is known only once the process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from nemo_msa.megatron.layer_specs import te_unavailable_reason
from nemo_msa.support import precision_refusal
from nemo_msa.training.determinism import REQUIRED_MODEL_VALUES
from nemo_msa.training.probes import check_probe_settings
from nemo_msa.training.recipe_fields import RecipeError, require
from nemo_msa.training.recipe_schema import (
    PACKED_FORMATS,
    SECTION_DATACLASSES,
    SECTIONS,
    GPTModelArgs,
    Recipe,
    coerce_value,
    section_schema,
    transformer_config_class,
    unknown_key_error,
)

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "msa_tiny.yaml"


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
    expected = f"a YAML mapping of sections ({', '.join(SECTIONS)})"
    try:
        base = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise RecipeError(f"recipe file {str(path)!r} is not valid YAML: "
                          f"{_yaml_problem(err)}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"recipe file {str(path)!r} is not UTF-8 text; expected "
                          f"{expected}") from None
    if not isinstance(base, dict) and not OmegaConf.is_dict(base):
        raise RecipeError(f"recipe {str(path)!r} must be a mapping of sections, got a list")
    if not base:
        raise RecipeError(f"recipe file {str(path)!r} is empty; expected {expected}")
    # Before the merge, which would replace a section that is not a mapping with the
    # overrides' (model: 5 plus model.num_layers=2 became a model of defaults).
    _check_sections(OmegaConf.to_container(base, resolve=False))
    merged = OmegaConf.merge(base, parse_overrides(list(overrides or [])))
    raw = OmegaConf.to_container(merged, resolve=True)
    return validate_recipe(raw, source=str(path))


def _check_sections(raw: dict[str, Any]) -> None:
    """Every section is known and a mapping of key: value (or empty).

    Raises:
        RecipeError: naming an unknown section (and the closest known one), or a section whose
            body is not a mapping (``model: 5``, ``model: 0``, ``model: [1, 2]``).
    """
    for section, body in raw.items():
        if section not in SECTIONS:
            close = difflib.get_close_matches(str(section), SECTIONS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise RecipeError(
                f"recipe section '{section}' is unknown.{hint} Valid sections: "
                f"{', '.join(SECTIONS)}"
            )
        if body is not None and not isinstance(body, dict):
            raise RecipeError(
                f"recipe section '{section}' must be a mapping of key: value, got {body!r}"
            )


#: ``model`` keys without a usable default: TransformerConfig's are 0 (num_attention_heads = 0
#: is a ZeroDivisionError when the config is built).
REQUIRED_MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads")


def validate_recipe(raw: dict[str, Any], source: str = "<dict>") -> Recipe:
    """Check every section and key of a plain-dict recipe and build the Recipe."""
    _check_sections(raw)
    for key in REQUIRED_MODEL_KEYS:
        if (raw.get("model") or {}).get(key) is None:
            raise RecipeError(f"recipe key 'model.{key}' is not set: expected a positive integer "
                              "(the model section must give num_layers, hidden_size and "
                              "num_attention_heads)")
    values: dict[str, Any] = {}
    for section in SECTIONS:
        body = raw.get(section) or {}
        valid = section_schema(section).types
        for key in body:
            if key not in valid:
                raise unknown_key_error(section, str(key))
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

#: Megatron's annealing shapes of the WSD schedule (``lr_wsd_decay_style``).
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")

#: ``model.position_embedding_type`` values the MSA and dense layers run with.
POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")

#: Ranges of numeric keys: (lowest, lowest included, highest, highest included); null passes.
_RANGES: dict[str, tuple[float | None, bool, float | None, bool]] = {
    "train.seed": (0, True, None, False),
    "train.exit_interval": (0, False, None, False),
    "train.eval_interval": (0, False, None, False),
    "train.eval_iters": (0, False, None, False),
    "train.eval_copy_marker": (0, True, None, False),
    "train.eval_probe_seed": (0, True, None, False),
    "train.exit_duration_in_mins": (0, False, None, False),
    "scheduler.lr_warmup_init": (0, True, None, False),
    "scheduler.lr_decay_iters": (0, False, None, False),
    "scheduler.lr_wsd_decay_iters": (0, True, None, False),
    "scheduler.start_weight_decay": (0, True, None, False),
    "scheduler.end_weight_decay": (0, True, None, False),
    "checkpoint.keep_last": (0, False, None, False),
    "checkpoint.lock_stale_s": (0, False, None, False),
    "dist.timeout_minutes": (0, False, None, False),
    # One token id cannot be learned apart from another: at least two.
    "model.vocab_size": (2, True, None, False),
    "model.make_vocab_size_divisible_by": (0, False, None, False),
    "model.rotary_percent": (0, False, 1, True),
    "model.rotary_base": (0, False, None, False),
    "model.init_method_std": (0, False, None, False),
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
    "model.mtp_num_layers": (0, False, None, False),
    "model.mtp_loss_scaling_factor": (0, True, None, False),
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
            require(False, key, value, f"{lo}value{hi}")


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
        require(False, "dataset.split", split, expected)
    weights = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    require(weights[0] > 0, "dataset.split", split, expected)
    return weights


def _check_values(r: Recipe) -> None:
    _check_ranges(r)
    t = r.train
    parse_split(r.dataset.split)
    if r.dataset.eod_id is not None:
        require(0 <= r.dataset.eod_id < r.gpt.vocab_size, "dataset.eod_id", r.dataset.eod_id,
                f"a token id inside the vocabulary, 0 <= id < model.vocab_size "
                f"({r.gpt.vocab_size})")
    require(t.train_iters > 0, "train.train_iters", t.train_iters, "a positive integer")
    require(t.micro_batch_size > 0, "train.micro_batch_size", t.micro_batch_size, "> 0")
    require(t.global_batch_size > 0 and t.global_batch_size % t.micro_batch_size == 0,
            "train.global_batch_size", t.global_batch_size,
            f"a positive multiple of train.micro_batch_size ({t.micro_batch_size})")
    require(r.gpt.seq_length > 0, "model.seq_length", r.gpt.seq_length, "a positive integer")
    _check_context_parallel(r)
    _check_packed_format(r)
    _check_mtp(r)
    _check_megatron_features(r)
    # GPTModel takes others (mrope, yarn) that apply row positions, not per-document ones.
    require(r.gpt.position_embedding_type in POSITION_EMBEDDINGS, "model.position_embedding_type",
            r.gpt.position_embedding_type,
            "'rope' (per-document positions), 'learned_absolute' or 'none' (no position encoding)")
    impl = r.model.setdefault("transformer_impl", "local")
    require(impl in ("local", "transformer_engine"), "model.transformer_impl", impl,
            "'local' (torch modules) or 'transformer_engine'")
    _check_precision(r, impl)
    if r.model.get("deterministic_mode"):
        for key, value in REQUIRED_MODEL_VALUES.items():
            require(bool(r.model.get(key, False)) == value, f"model.{key}", r.model.get(key),
                    f"{str(value).lower()} with model.deterministic_mode=true (it has no "
                    "deterministic form; Megatron-LM's --deterministic-mode requires the same)")
    require(r.dist.backend in ("auto", "nccl", "gloo"), "dist.backend", r.dist.backend,
            "'auto', 'nccl' or 'gloo'")
    require(r.logger.log_interval > 0, "logger.log_interval", r.logger.log_interval, "> 0")
    decay = r.scheduler.lr_decay_iters or t.train_iters
    require(0 <= r.scheduler.lr_warmup_iters < decay, "scheduler.lr_warmup_iters",
            r.scheduler.lr_warmup_iters,
            f"0 <= value < scheduler.lr_decay_iters (or train.train_iters) = {decay}")
    lr, min_lr = r.optimizer.get("lr"), r.optimizer.get("min_lr")
    if lr is not None and min_lr is not None:
        require(float(min_lr) <= float(lr), "optimizer.min_lr", min_lr,
                f"<= optimizer.lr ({lr})")
    sch = r.scheduler
    require(not (sch.override_opt_param_scheduler and sch.use_checkpoint_opt_param_scheduler),
            "scheduler.use_checkpoint_opt_param_scheduler", True,
            "false when scheduler.override_opt_param_scheduler is true (pick one)")
    c = r.checkpoint
    _check_save_path(c.save)
    if c.lock_stale_s is not None:
        # Rank 0 may watch a foreign holder's heartbeat this long while the others wait.
        require(c.lock_stale_s < r.dist.timeout_minutes * 60, "checkpoint.lock_stale_s",
                c.lock_stale_s, f"less than dist.timeout_minutes x 60 = "
                f"{r.dist.timeout_minutes * 60} s (the other ranks wait that long for rank 0 "
                "to take the lock), or null")
    if c.save_interval is not None:
        require(c.save_interval > 0, "checkpoint.save_interval", c.save_interval, "> 0 or null")
        require(c.save is not None, "checkpoint.save", c.save,
                "a directory when checkpoint.save_interval is set")
    require(r.scheduler.lr_decay_style in ("constant", "linear", "cosine", "inverse-square-root",
                                           "WSD"),
            "scheduler.lr_decay_style", r.scheduler.lr_decay_style,
            "one of constant, linear, cosine, inverse-square-root, WSD")
    if r.scheduler.lr_decay_style == "WSD":
        # Megatron's scheduler asserts both; say which key is missing instead.
        require(bool(r.scheduler.lr_wsd_decay_iters), "scheduler.lr_wsd_decay_iters",
                r.scheduler.lr_wsd_decay_iters,
                "a positive number of annealing steps with scheduler.lr_decay_style=WSD")
        require(r.scheduler.lr_wsd_decay_style in WSD_DECAY_STYLES,
                "scheduler.lr_wsd_decay_style", r.scheduler.lr_wsd_decay_style,
                f"one of {', '.join(WSD_DECAY_STYLES)}")
    marker = r.train.eval_copy_marker
    if marker is not None:
        require(marker < r.gpt.vocab_size, "train.eval_copy_marker", marker,
                f"a token id below model.vocab_size = {r.gpt.vocab_size}")
        # The marker count runs along the whole row; a CP rank holds two chunks of it.
        require(int(r.model.get("context_parallel_size", 1) or 1) == 1,
                "train.eval_copy_marker", marker,
                "null with model.context_parallel_size > 1 (the recall loss counts markers "
                "along whole rows)")
    require(not t.skip_train or t.eval_interval is not None, "train.skip_train", t.skip_train,
            "false without evaluation (a run that skips training only evaluates: set "
            "train.eval_interval)")
    eod = r.dataset.eod_id if r.dataset.eod_id is not None else r.gpt.vocab_size - 1
    check_probe_settings(r.train, r.gpt.seq_length, r.gpt.vocab_size, eod)
    optimizer = r.optimizer.get("optimizer", "adam")
    require(optimizer in ("adam", "sgd"), "optimizer.optimizer", optimizer,
            "'adam' or 'sgd' (Megatron-Core's own optimizers)")


def _check_save_path(save: str | None) -> None:
    """``checkpoint.save`` names a directory, or a path whose first existing part is one.

    Raises:
        RecipeError: the path, or a part of it, is an existing file (naming which).
    """
    if save is None:
        return
    path = Path(save)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "is an existing file" if part == path else f"lies under the file {part}"
                require(False, "checkpoint.save", save,
                        f"a checkpoint directory (or a path to create one at), but it {what}")
            return


def _check_precision(r: Recipe, impl: str) -> None:
    """The gate's precision rules (``nemo_msa.support.precision_refusal``) on the recipe's keys,
    then what only a recipe decides: bf16 with FP8, and Transformer Engine on this machine."""
    refusal = precision_refusal(lambda name: impl if name == "transformer_impl"
                                else r.model.get(name))
    if refusal is not None:
        require(False, f"model.{refusal.field}", refusal.value, refusal.expected)
    fp8 = r.model.get("fp8")
    if fp8:
        require(bool(r.model.get("bf16")), "model.bf16", r.model.get("bf16"),
                "true with model.fp8 (the attention and the indexer run in bf16)")
        reason = te_unavailable_reason()
        require(reason is None, "model.fp8", fp8,
                f"null on this machine: FP8 needs Transformer Engine ({reason})")
    for key in ("fp8_param", "fp8_dot_product_attention", "fp8_multi_head_attention"):
        if r.model.get(key) and not fp8:
            require(False, f"model.{key}", r.model.get(key), "false without model.fp8")


def _check_context_parallel(r: Recipe) -> None:
    """The sequence must split into 2 x CP equal chunks (and each rank's share over TP with SP)."""
    cp = int(r.model.get("context_parallel_size", 1) or 1)
    if cp == 1:
        return
    require(r.gpt.seq_length % (2 * cp) == 0, "model.seq_length", r.gpt.seq_length,
            f"a multiple of 2 x model.context_parallel_size = {2 * cp} (Megatron's "
            "load-balanced split cuts each sequence into 2 x CP chunks)")
    tp = int(r.model.get("tensor_model_parallel_size", 1) or 1)
    if r.model.get("sequence_parallel") and tp > 1:
        require((r.gpt.seq_length // cp) % tp == 0, "model.seq_length", r.gpt.seq_length,
                f"a multiple of model.context_parallel_size x tensor_model_parallel_size = "
                f"{cp * tp} with sequence_parallel (each CP rank's share splits over TP)")


def _check_packed_format(r: Recipe) -> None:
    """``dataset.packed_format``: a known format, and THD only where its data path runs."""
    fmt = r.dataset.packed_format
    require(fmt in PACKED_FORMATS, "dataset.packed_format", fmt,
            "'bshd' ([b, S] rows with document ids) or 'thd' (Megatron's PackedSeqParams)")
    cp = int(r.model.get("context_parallel_size", 1) or 1)
    if fmt == "thd":
        # The layer takes THD under CP, but only with every document padded to a multiple of
        # 2 x CP and split per document (cu_seqlens_q_padded); the data path does not do that.
        require(cp == 1, "dataset.packed_format", fmt,
                f"'bshd' with model.context_parallel_size = {cp} (the THD data path does not "
                "pad and split documents for context parallelism; the document-id path does "
                "CP)")


def _check_mtp(r: Recipe) -> None:
    """Multi-token prediction: what Megatron's MTP block runs with in this trainer."""
    model = r.model
    if model.get("mtp_hybrid_override_pattern") is not None:
        require(False, "model.mtp_hybrid_override_pattern", model["mtp_hybrid_override_pattern"],
                "null (it patterns the MTP layers of Megatron's hybrid Mamba models; a GPT's "
                "MTP layer is its last decoder layer's kind)")
    if not model.get("mtp_num_layers"):
        for key in ("mtp_use_repeated_layer", "mtp_detach_heads"):
            if model.get(key):
                require(False, f"model.{key}", model[key], "false without model.mtp_num_layers")
        return
    if model.get("recompute_granularity") == "full" and model.get("recompute_method") == "uniform":
        # MultiTokenPredictionLayer asserts it in its first recomputed forward.
        require(int(model.get("recompute_num_layers") or 0) == 1, "model.recompute_num_layers",
                model.get("recompute_num_layers"),
                "1 with model.mtp_num_layers and recompute_method 'uniform' (Megatron recomputes "
                "each MTP layer on its own)")


def _check_megatron_features(r: Recipe) -> None:
    """Megatron fields the config accepts but this trainer's model cannot run, refused here
    rather than as a traceback at the first step (or silently ignored)."""
    model = r.model
    variant = model.get("experimental_attention_variant")
    require(variant is None, "model.experimental_attention_variant", variant,
            "null (the MSA spec builds every attention layer: MSA or dense by "
            "model.msa_layer_pattern)")
    tp = int(model.get("tensor_model_parallel_size", 1) or 1)
    sp = bool(model.get("sequence_parallel"))
    if model.get("num_moe_experts") is not None and tp > 1:
        # Megatron's MoELayer raises this in its first training forward.
        require(sp, "model.sequence_parallel", sp,
                f"true with model.num_moe_experts and tensor_model_parallel_size = {tp} "
                "(Megatron's MoE layer does not train with TP but without sequence parallelism)")
    if sp and tp > 1:
        require(model.get("transformer_impl") == "transformer_engine", "model.sequence_parallel",
                sp, "false with model.transformer_impl = 'local' (Megatron's local norms do not "
                "support sequence parallelism; use transformer_engine)")


def check_parallel_layout(model: dict[str, Any], world_size: int, global_batch_size: int,
                          micro_batch_size: int, num_layers: int) -> int:
    """Check that the parallel layout fits the world size; return the data-parallel size.

    Raises:
        RecipeError: naming the sizes when TP*PP*CP does not divide the world size, when the
            layers do not split evenly over the pipeline (virtual) stages, when the global
            batch is not a multiple of micro batch * data parallel, or when expert parallelism
            (EP) does not divide the experts or PP*EP*ETP the world size.
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
        require(int(vpp) >= 2 and pp >= 2, "model.virtual_pipeline_model_parallel_size", vpp,
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
    experts = model.get("num_moe_experts")
    ep = int(model.get("expert_model_parallel_size", 1) or 1)
    etp = model.get("expert_tensor_parallel_size")
    etp = tp if etp is None else int(etp)
    if experts is not None or ep > 1:
        require(experts is not None and int(experts) % ep == 0,
                "model.expert_model_parallel_size", ep,
                f"a divisor of model.num_moe_experts = {experts}")
        require(world_size % (pp * ep * etp) == 0, "model.expert_model_parallel_size", ep,
                f"a layout whose pipeline_model_parallel_size x expert_model_parallel_size x "
                f"expert_tensor_parallel_size = {pp} x {ep} x {etp} divides the world size "
                f"{world_size}")
    if vpp is not None:
        nmb = global_batch_size // (micro_batch_size * dp)
        require(nmb % pp == 0, "train.global_batch_size", global_batch_size,
                f"a number of microbatches ({nmb}) that is a multiple of "
                f"pipeline_model_parallel_size ({pp}) for the interleaved schedule")
    return dp


__all__ = ["DEFAULT_RECIPE", "RECIPES_DIR", "Recipe", "RecipeError", "check_parallel_layout",
           "load_recipe", "parse_overrides", "parse_split", "validate_recipe"]
