"""Megatron-Bridge recipes of this project's MSA models (ADR 0055).

A Bridge recipe is a function that returns a ``ConfigContainer``. These build one from this
project's YAML recipes (``recipes/*.yaml``), so each architecture is stated once: the model
section becomes an :class:`~nemo_msa.bridge.config.MSABridgeTransformerConfig` inside an
:class:`~nemo_msa.bridge.config.MSAGPTModelConfig`, and the train, optimizer, scheduler,
dataset, logger and checkpoint sections become Bridge's configs (the fields Bridge's
``_pretrain_common()`` sets, which is not imported: ``megatron.bridge.recipes`` imports every
model family's recipes, diffusers among them). Megatron's mock documents
(``dataset.data_path: null``) use Bridge's ``NullTokenizer``, whose EOD (``vocab_size - 1``)
ends every mock document, as in ``scripts/pretrain.py``. Train with Bridge's
``pretrain(config, nemo_msa.bridge.step.forward_step)``.

- :func:`msa_tiny_pretrain_config`: ``recipes/msa_tiny.yaml`` (3.3M parameters, 4 MSA layers).
- :func:`minimax_m3_msa_pretrain_config`: ``recipes/minimax_m3_msa.yaml`` (MiniMax-M3's text
  backbone with MSA, TP=2 x PP=4 x EP=32, bf16, TE; M3's Hugging Face tokenizer).
- :func:`minimax_m3_tiny_pretrain_config`: ``recipes/minimax_m3_tiny.yaml`` (the same
  architecture at toy size).
- :func:`pretrain_config_from_recipe`: any of them, with the YAML recipes' overrides.

Bridge's training configs import more than ``megatron.bridge`` itself (HF ``datasets``,
``megatron-energon``, ``nvidia-modelopt``, ``nvidia-resiliency-ext``, ...; ADR 0055), so this
module and :mod:`nemo_msa.bridge.step` are imported on their own, not by the package.
"""

from __future__ import annotations

import os

from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    DistributedInitConfig,
    GPTDatasetConfig,
    LoggerConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron.bridge.training.mixed_precision import MixedPrecisionConfig

from nemo_msa.bridge.config import model_config_from_recipe
from nemo_msa.training.recipe import RECIPES_DIR, load_recipe

__all__ = [
    "minimax_m3_msa_pretrain_config",
    "minimax_m3_tiny_pretrain_config",
    "msa_tiny_pretrain_config",
    "pretrain_config_from_recipe",
]

#: MiniMax-M3's Hugging Face repository (its tokenizer; Bridge's M3 recipe names it too).
MINIMAX_M3_HF_PATH = "MiniMaxAI/MiniMax-M3"
#: The YAML scheduler keys that Bridge's SchedulerConfig takes under the same names.
_SCHEDULER_KEYS = ("lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "lr_warmup_init",
                   "lr_wsd_decay_style", "lr_wsd_decay_iters", "weight_decay_incr_style",
                   "start_weight_decay", "end_weight_decay")


def pretrain_config_from_recipe(path: str | os.PathLike, overrides: list[str] | None = None,
                                *, tokenizer_model: str | None = None) -> ConfigContainer:
    """A Bridge ``ConfigContainer`` of one of this project's YAML recipes.

    Args:
        path: the YAML recipe.
        overrides: ``section.key=value`` overrides, as ``scripts/pretrain.py`` takes them
            (``checkpoint.save`` null keeps Bridge from saving; Bridge logs to stdout).
        tokenizer_model: a Hugging Face tokenizer (name or path) for a real corpus; None:
            Bridge's ``NullTokenizer``, whose EOD must be the recipe's (``vocab_size - 1``).

    Returns:
        The container; Bridge's ``pretrain`` finalizes it (MSA's checks run then).

    Raises:
        nemo_msa.training.recipe.RecipeError: a bad recipe key or value, named.
    """
    recipe = load_recipe(path, overrides or [])
    model = model_config_from_recipe(recipe)
    train, gpt, dataset = recipe.train, recipe.gpt, recipe.dataset
    if tokenizer_model is None and dataset.eod_id not in (None, gpt.vocab_size - 1):
        raise ValueError(
            f"dataset.eod_id={dataset.eod_id!r}: Bridge's NullTokenizer ends documents with "
            f"vocab_size - 1 = {gpt.vocab_size - 1}; expected null or that id, or pass "
            "tokenizer_model")
    tokenizer = (TokenizerConfig(tokenizer_type="NullTokenizer", tokenizer_model=None,
                                 vocab_size=gpt.vocab_size) if tokenizer_model is None else
                 TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                 tokenizer_model=tokenizer_model))
    bf16 = bool(model.transformer.bf16)
    optimizer = OptimizerConfig(**{"use_distributed_optimizer": False, **recipe.optimizer,
                                   "bf16": bf16, "fp16": bool(model.transformer.fp16)})
    distributed_optimizer = bool(optimizer.use_distributed_optimizer)
    scheduler = SchedulerConfig(lr_decay_iters=train.train_iters)
    for key in _SCHEDULER_KEYS:
        value = getattr(recipe.scheduler, key, None)
        if value is not None:
            setattr(scheduler, key, value)
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=train.train_iters,
                             global_batch_size=train.global_batch_size,
                             micro_batch_size=train.micro_batch_size, manual_gc=False),
        validation=ValidationConfig(eval_interval=train.eval_interval,
                                    eval_iters=train.eval_iters if train.eval_interval else 0),
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=DistributedDataParallelConfig(
            check_for_nan_in_grad=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            overlap_param_gather=False, average_in_collective=True,
            data_parallel_sharding_strategy="no_shard",
            use_distributed_optimizer=distributed_optimizer),
        dataset=GPTDatasetConfig(
            random_seed=train.seed, reset_attention_mask=False, reset_position_ids=False,
            eod_mask_loss=dataset.eod_mask_loss, seq_length=gpt.seq_length,
            num_dataset_builder_threads=1, blend=_blend(dataset.data_path), split=dataset.split,
            data_sharding=True, dataloader_type="single", num_workers=0,
            # Middle pipeline stages read the microbatch too: their MSA layers need the
            # document map (nemo_msa.bridge.step).
            skip_getting_attention_mask_from_dataset=False, create_attention_mask=False),
        logger=LoggerConfig(log_interval=recipe.logger.log_interval),
        tokenizer=tokenizer,
        checkpoint=CheckpointConfig(save_interval=recipe.checkpoint.save_interval,
                                    save=recipe.checkpoint.save, load=recipe.checkpoint.save,
                                    ckpt_format="torch_dist"),
        rng=RNGConfig(seed=train.seed),
        dist=DistributedInitConfig(),
        mixed_precision=MixedPrecisionConfig(
            bf16=bf16, params_dtype=model.transformer.params_dtype,
            pipeline_dtype=model.transformer.pipeline_dtype, autocast_enabled=False,
            grad_reduce_in_fp32=True),
    )


def _blend(data_path) -> tuple[list[str], list[float] | None] | None:
    """Bridge's ``blend`` of the recipe's ``dataset.data_path`` (prefixes, optionally as
    Megatron's ``[w1, prefix1, w2, prefix2, ...]``); None for mock documents."""
    if not data_path:
        return None
    paths = [data_path] if isinstance(data_path, str) else list(data_path)
    if all(isinstance(p, str) for p in paths):
        return paths, None
    return [str(p) for p in paths[1::2]], [float(w) for w in paths[0::2]]


def msa_tiny_pretrain_config(overrides: list[str] | None = None) -> ConfigContainer:
    """``recipes/msa_tiny.yaml`` through Bridge: 4 MSA layers, mock documents."""
    return pretrain_config_from_recipe(RECIPES_DIR / "msa_tiny.yaml", overrides)


def minimax_m3_tiny_pretrain_config(overrides: list[str] | None = None) -> ConfigContainer:
    """``recipes/minimax_m3_tiny.yaml`` through Bridge: M3's block at toy size."""
    return pretrain_config_from_recipe(RECIPES_DIR / "minimax_m3_tiny.yaml", overrides)


def minimax_m3_msa_pretrain_config(overrides: list[str] | None = None) -> ConfigContainer:
    """``recipes/minimax_m3_msa.yaml`` through Bridge: MiniMax-M3's text backbone (60 layers, 128
    experts top-4 plus a shared one) with MSA on layers 4-60, TP=2 x PP=4 x EP=32, bf16 and
    Transformer Engine; load M3's weights with :func:`nemo_msa.bridge.load_minimax_m3_hf`."""
    return pretrain_config_from_recipe(RECIPES_DIR / "minimax_m3_msa.yaml", overrides,
                                       tokenizer_model=MINIMAX_M3_HF_PATH)
