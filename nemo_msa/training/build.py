"""What trains, built from the recipe: config, model chunks, DDP, optimizer, scheduler, data.

:func:`build_training` makes the (MSA) TransformerConfig, this rank's GPT model chunks (one per
virtual pipeline stage) wrapped in Megatron's DDP, Megatron's optimizer and its
OptimizerParamScheduler, and ties them to the pipeline schedules the way Megatron-LM does.
:func:`build_microbatch_source` opens the training data at the position a resume starts from.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import (
    OptimizerConfig,
    ParamKey,
    distrib_optimizer,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.optimizer.optimizer_config import ParamPredicate
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from nemo_msa.megatron import check_msa_layer_config, cpu_shim
from nemo_msa.training import msa_hooks
from nemo_msa.training.data import MicrobatchSource, build_train_dataset, eod_token_id
from nemo_msa.training.recipe import Recipe, RecipeError
from nemo_msa.training.recipe_schema import config_values, transformer_config_class
from nemo_msa.training.setup import RunContext


@dataclass
class TrainingObjects:
    """What :func:`build_training` made: the config and what the loop steps."""

    config: Any
    #: This rank's model chunks, each wrapped in Megatron's DDP (one per virtual stage).
    chunks: list
    optimizer: Any
    scheduler: OptimizerParamScheduler
    #: Parameters of the whole model (all tensor-parallel shards).
    num_params: int
    #: MSA or dense-GPT hooks of the loop (:func:`nemo_msa.training.msa_hooks.hooks_for`).
    hooks: msa_hooks.TrainingHooks


def build_config(recipe: Recipe, ctx: RunContext):
    """Build the (MSA) TransformerConfig from the model section plus platform settings.

    Raises:
        RecipeError: half precision or a shim-incompatible value on the CPU (an MoE dispatcher
            other than all-gather among them), or a model section that the config class refuses.
    """
    cls = transformer_config_class()
    # The YAML spellings of dtypes, activations and enums become the objects they name.
    fields = config_values("model", recipe.model)
    bf16 = bool(fields.get("bf16", False))
    fp16 = bool(fields.get("fp16", False))
    dtype = torch.bfloat16 if bf16 else (torch.float16 if fp16 else torch.float32)
    fields.setdefault("params_dtype", dtype)
    fields.setdefault("pipeline_dtype", dtype)
    if ctx.on_cpu and (bf16 or fp16):
        # Megatron's mixed-precision optimizer (Float16OptimizerWithFloat16Params) accepts only
        # torch.cuda.*Tensor parameters, so half-precision training has no CPU path.
        key = "bf16" if bf16 else "fp16"
        raise RecipeError(f"recipe key 'model.{key}' = True: expected false on the CPU "
                          f"(Megatron's mixed-precision optimizer needs CUDA tensors); pass "
                          f"model.{key}=false")
    if ctx.on_cpu:
        for name, value in cpu_shim.cpu_config_overrides().items():
            if name in recipe.model and recipe.model[name] != value:
                raise RecipeError(
                    f"recipe key 'model.{name}' = {recipe.model[name]!r}: expected {value!r} on "
                    "the CPU/gloo (see nemo_msa.megatron.cpu_shim)"
                )
            fields[name] = value
    try:
        config = cls(**fields)
    except (TypeError, ValueError, AssertionError) as err:
        raise RecipeError(f"the model section does not make a valid {cls.__name__}: {err}") from err
    if ctx.on_cpu:
        try:
            cpu_shim.check_cpu_config(config)
        except ValueError as err:
            raise RecipeError(f"the model section cannot run on the CPU: {err}") from None
    return config


def check_msa_layers(config) -> None:
    """Run the MSA layers' construction gate once, before the model is built.

    Each layer runs it when it is built, where a refusal (FP8, a backend that cannot run on this
    device, ...) surfaced as a traceback from inside Megatron's module construction.

    Raises:
        RecipeError: the gate's refusal, which names the config field and its value.
    """
    try:
        check_msa_layer_config(config, ps.get_tensor_model_parallel_world_size(),
                               ps.get_context_parallel_world_size())
    except (NotImplementedError, ValueError) as err:
        raise RecipeError(f"the model section cannot be built with MSA layers here: "
                          f"{err}") from None


def build_model(recipe: Recipe, config, hooks: msa_hooks.TrainingHooks) -> list:
    """Build this rank's model chunks (one per virtual pipeline stage), not yet wrapped, with
    the decoder spec of ``hooks`` (MSA or Megatron's dense GPT) and, with ``mtp_num_layers``,
    Megatron's multi-token-prediction block on the last stage (ADR 0053)."""
    vpp = config.virtual_pipeline_model_parallel_size
    pp_rank = ps.get_pipeline_model_parallel_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    divisor = recipe.gpt.make_vocab_size_divisible_by * tp
    padded_vocab = int(math.ceil(recipe.gpt.vocab_size / divisor) * divisor)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = GPTModel(
                config=config,
                transformer_layer_spec=hooks.layer_spec(stage, pp_rank),
                vocab_size=padded_vocab,
                max_sequence_length=recipe.gpt.seq_length,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=recipe.gpt.share_embeddings_and_output_weights,
                position_embedding_type=recipe.gpt.position_embedding_type,
                rotary_percent=recipe.gpt.rotary_percent,
                rotary_base=recipe.gpt.rotary_base,
                mtp_block_spec=hooks.mtp_block_spec(stage, pp_rank),
                vp_stage=stage,
            )
        chunks.append(model)
    return chunks


def wrap_ddp(recipe: Recipe, config, chunks: list, device: torch.device) -> list:
    """Move to the device, wrap in Float16Module for bf16/fp16, then in Megatron's DDP."""
    ddp_fields = config_values("ddp", recipe.ddp)
    if config.bf16:
        # Megatron-LM's default for bf16: reduce gradients in fp32 so that DP sums do not lose
        # precision; a recipe may still say otherwise.
        ddp_fields.setdefault("grad_reduce_in_fp32", True)
    ddp_config = DistributedDataParallelConfig(**ddp_fields)
    wrapped = []
    for i, chunk in enumerate(chunks):
        chunk.to(device)
        if config.bf16 or config.fp16:
            chunk = Float16Module(config, chunk)
        wrapped.append(DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=chunk,
            # Megatron-LM: only the first chunk buckets, so that the overlap of grad reduce
            # with the backward of the later chunks works out.
            disable_bucketing=i > 0,
        ))
    return wrapped


def build_optimizer(recipe: Recipe, config, chunks: list, ctx: RunContext):
    """Megatron's optimizer (get_megatron_optimizer) and OptimizerParamScheduler.

    Raises:
        RecipeError: grad clipping or the distributed optimizer on the CPU.
    """
    fields = config_values("optimizer", recipe.optimizer)
    fields.setdefault("bf16", config.bf16)
    fields.setdefault("fp16", config.fp16)
    fields.setdefault("params_dtype", config.params_dtype)
    opt_config = OptimizerConfig(**fields)
    if ctx.on_cpu:
        # Megatron's grad clipping asserts torch.cuda.FloatTensor grads and the distributed
        # optimizer allocates CUDA buffers; neither has a CPU path (PLATFORM.md).
        if opt_config.clip_grad and opt_config.clip_grad > 0:
            raise RecipeError(
                f"recipe key 'optimizer.clip_grad' = {opt_config.clip_grad}: expected 0.0 on the "
                "CPU (Megatron's clip_grad_norm asserts CUDA tensors); pass optimizer.clip_grad=0"
            )
        if opt_config.use_distributed_optimizer:
            raise RecipeError(
                "recipe key 'optimizer.use_distributed_optimizer' = True: expected false on the "
                "CPU (Megatron's distributed optimizer needs CUDA buffers)"
            )
    overrides = get_standard_config_overrides(opt_config)
    indexer_ids = msa_hooks.indexer_param_ids(chunks)
    if indexer_ids:
        # The indexer gets param groups of its own (marked msa_indexer), so that the dense
        # warm-up can hold every other group still while the indexer learns.
        _register_group_identifier("msa_indexer")
        is_indexer = ParamPredicate(name="msa_indexer", fn=lambda p: id(p) in indexer_ids)
        overrides[ParamKey(predicate=is_indexer)] = {"msa_indexer": True}
    optimizer = get_megatron_optimizer(opt_config, chunks, config_overrides=overrides)
    s = recipe.scheduler
    train_iters = recipe.train.train_iters
    wd = opt_config.weight_decay
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=s.lr_warmup_init,
        max_lr=opt_config.lr,
        min_lr=opt_config.min_lr if opt_config.min_lr is not None else 0.0,
        lr_warmup_steps=s.lr_warmup_iters,
        lr_decay_steps=s.lr_decay_iters or train_iters,
        lr_decay_style=s.lr_decay_style,
        start_wd=s.start_weight_decay if s.start_weight_decay is not None else wd,
        end_wd=s.end_weight_decay if s.end_weight_decay is not None else wd,
        wd_incr_steps=train_iters,
        wd_incr_style=s.weight_decay_incr_style,
        wsd_decay_steps=s.lr_wsd_decay_iters,
        lr_wsd_decay_style=s.lr_wsd_decay_style,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
    )
    return optimizer, scheduler


def _register_group_identifier(key: str) -> None:
    """Make Megatron tell param groups apart by ``key`` when it loads optimizer state.

    Megatron matches saved to current param groups by a tuple of per-group keys
    (``param_group_identifier_keys``); groups that differ only in a key missing from that tuple
    collide and the load fails (or, worse, pairs the wrong groups). Megatron's own comment names
    extending the tuple as the fix for a new distinguishing field.
    """
    # distrib_optimizer imported the tuple by value, so both module globals are extended.
    for module in (mcore_optimizer, distrib_optimizer):
        if key not in module.param_group_identifier_keys:
            module.param_group_identifier_keys = (*module.param_group_identifier_keys, key)


def connect_schedule_hooks(config, chunks: list, optimizer) -> None:
    """Give the config the hooks that Megatron's schedules call, as Megatron-LM wires them.

    Loss scaling comes from the optimizer; no-sync, grad-sync and param-sync come from the DDP
    chunks (so the schedules overlap DP communication with compute); finalize_model_grads does
    the DP and embedding all-reduces after the backward.
    """
    config.grad_scale_func = optimizer.scale_loss

    def per_chunk(name: str):
        funcs = [getattr(c, name) for c in chunks]
        return funcs if len(funcs) > 1 else funcs[0]

    config.no_sync_func = per_chunk("no_sync")
    ddp_config = chunks[0].ddp_config
    if ddp_config.overlap_grad_reduce:
        config.grad_sync_func = per_chunk("start_grad_sync")
    if ddp_config.overlap_param_gather and getattr(ddp_config, "align_param_gather", False):
        config.param_sync_func = per_chunk("start_param_sync")
    config.finalize_model_grads_func = finalize_model_grads


def count_parameters(chunks: list, device) -> int:
    """Parameters of the whole model (collective over the model-parallel group).

    Tensor-parallel shards add up; parameters replicated across TP ranks count once.
    """
    tp_rank = ps.get_tensor_model_parallel_rank()
    local = sum(p.numel() for c in chunks for p in c.parameters()
                if getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
    total = torch.tensor([local], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(total, group=ps.get_model_parallel_group())
    return int(total.item())


def build_training(recipe: Recipe, ctx: RunContext) -> TrainingObjects:
    """Build the config, the DDP-wrapped model chunks, the optimizer and the scheduler.

    Needs the model-parallel groups (:func:`nemo_msa.training.setup.init_model_parallel`) and
    the seeds set, since the weights are initialised here.

    Raises:
        RecipeError: a value that cannot be built here (see :func:`build_config`,
            :func:`build_optimizer`).
    """
    config = build_config(recipe, ctx)
    hooks = msa_hooks.hooks_for(config)
    if hooks.msa:
        check_msa_layers(config)
    elif recipe.dataset.packed_format == "thd":
        raise RecipeError("recipe key 'dataset.packed_format' = 'thd': expected 'bshd' for a "
                          "model without MSA layers (Megatron's local attention takes [b, s] "
                          "rows, not THD packs)")
    chunks = wrap_ddp(recipe, config, build_model(recipe, config, hooks), ctx.device)
    optimizer, scheduler = build_optimizer(recipe, config, chunks, ctx)
    connect_schedule_hooks(config, chunks, optimizer)
    return TrainingObjects(config, chunks, optimizer, scheduler,
                           count_parameters(chunks, ctx.device), hooks)


def build_microbatch_source(recipe: Recipe, ctx: RunContext, dp: int,
                            consumed_samples: int) -> MicrobatchSource:
    """This data-parallel rank's microbatches, starting after ``consumed_samples`` samples.

    Raises:
        RecipeError: a dataset path or token range that does not fit the recipe.
    """
    train = recipe.train
    dataset = build_train_dataset(recipe.dataset, recipe.gpt, train.seed,
                                  train.train_iters * train.global_batch_size)
    return MicrobatchSource(
        dataset, micro_batch_size=train.micro_batch_size,
        global_batch_size=train.global_batch_size, dp_size=dp,
        dp_rank=ps.get_data_parallel_rank(), eod_id=eod_token_id(recipe.dataset, recipe.gpt),
        device=ctx.device, consumed_samples=consumed_samples,
        reset_position_ids=recipe.dataset.reset_position_ids,
        cp_size=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
        packed_format=recipe.dataset.packed_format,
    )


__all__ = ["TrainingObjects", "build_config", "build_microbatch_source", "build_model",
           "build_optimizer", "build_training", "check_msa_layers", "connect_schedule_hooks",
           "count_parameters", "wrap_ddp"]
