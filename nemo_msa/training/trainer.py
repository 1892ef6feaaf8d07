"""The pretraining loop: Megatron-Core model, DDP, optimizer, schedules, checkpoints.

One function, :func:`pretrain`, does what ``scripts/pretrain.py`` runs: initialise the process
group (NCCL on GPUs; gloo plus the project's CPU shim on the CPU), the model-parallel groups and
the seeds; build the GPT model chunks from the MSA layer spec; wrap them in Megatron's DDP; build
Megatron's optimizer and OptimizerParamScheduler; resume from the newest finished checkpoint;
then run ``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved, as the layout asks)
step by step, logging, checkpointing and plotting on the way.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import random
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_msa.megatron import cpu_shim
from nemo_msa.megatron.microbatch import SharedMicrobatchIterators
from nemo_msa.training import cpu_extras, msa_hooks
from nemo_msa.training.checkpoint import (
    TrainState,
    find_resume_iteration,
    load_checkpoint,
    save_checkpoint,
)
from nemo_msa.training.data import MicrobatchSource, build_train_dataset, eod_token_id
from nemo_msa.training.recipe import (
    Recipe,
    RecipeError,
    check_parallel_layout,
    config_values,
    transformer_config_class,
)
from nemo_msa.training.ux import (
    MetricsLog,
    Progress,
    StepTimer,
    format_summary,
    plot_loss_curve,
)

logger = logging.getLogger(__name__)


#: What pretrain() set up in this process, so that teardown() undoes exactly that.
_OWNED: dict[str, bool] = {"process_group": False, "cpu_shim": False}


@dataclass
class RunContext:
    """Process-level facts of this run."""

    rank: int
    world_size: int
    device: torch.device
    on_cpu: bool
    owns_process_group: bool


def init_distributed(recipe: Recipe) -> RunContext:
    """Initialise torch.distributed (torchrun env or a 1-rank group) and the CPU shim.

    Under torchrun the rendezvous comes from the environment (RANK, WORLD_SIZE, MASTER_ADDR...);
    a plain ``python scripts/pretrain.py`` gets a 1-rank group on an in-memory store.
    """
    dist = recipe.dist
    on_cpu = dist.force_cpu or not torch.cuda.is_available()
    backend = dist.backend if dist.backend != "auto" else ("gloo" if on_cpu else "nccl")
    if on_cpu and backend == "nccl":
        raise RecipeError("recipe key 'dist.backend' = 'nccl': expected 'gloo' or 'auto' on a "
                          "machine without CUDA (or with dist.force_cpu=true)")
    owns = False
    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(minutes=dist.timeout_minutes)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if not on_cpu:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(backend=backend, timeout=timeout)
        else:
            if not on_cpu:
                torch.cuda.set_device(0)
            store = torch.distributed.HashStore()
            torch.distributed.init_process_group(backend=backend, store=store, rank=0,
                                                 world_size=1, timeout=timeout)
        owns = True
        _OWNED["process_group"] = True
    if on_cpu and not _OWNED["cpu_shim"]:
        cpu_shim.install()
        cpu_extras.install()
        _OWNED["cpu_shim"] = True
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    return RunContext(torch.distributed.get_rank(), torch.distributed.get_world_size(), device,
                      on_cpu, owns)


def set_seeds(seed: int) -> None:
    """Seed like Megatron-LM: a different stream per pipeline stage, the TP tracker from seed."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _yaml_to_config_values(fields: dict[str, Any]) -> dict[str, Any]:
    """Turn the YAML spellings of non-scalar config fields (activation, dtypes, enums) into
    Python objects; the recipe has already checked every value against its field's type."""
    return config_values("model", fields)


def build_config(recipe: Recipe, ctx: RunContext):
    """Build the (MSA) TransformerConfig from the model section plus platform settings."""
    cls = msa_hooks_config_class()
    fields = _yaml_to_config_values(recipe.model)
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
        cpu_shim.check_cpu_config(config)
    return config


def msa_hooks_config_class():
    """The config class for the model section (MSA when available)."""

    return transformer_config_class()


def build_model(recipe: Recipe, config) -> list:
    """Build this rank's model chunks (one per virtual pipeline stage), not yet wrapped."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

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
                transformer_layer_spec=msa_hooks.layer_spec(config, stage, pp_rank),
                vocab_size=padded_vocab,
                max_sequence_length=recipe.gpt.seq_length,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=recipe.gpt.share_embeddings_and_output_weights,
                position_embedding_type=recipe.gpt.position_embedding_type,
                rotary_percent=recipe.gpt.rotary_percent,
                rotary_base=recipe.gpt.rotary_base,
                vp_stage=stage,
            )
        chunks.append(model)
    return chunks


def wrap_ddp(recipe: Recipe, config, chunks: list, device: torch.device) -> list:
    """Move to the device, wrap in Float16Module for bf16/fp16, then in Megatron's DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

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
    """Megatron's optimizer (get_megatron_optimizer) and OptimizerParamScheduler."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        ParamKey,
        get_megatron_optimizer,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer.optimizer_config import ParamPredicate
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer

    # distrib_optimizer imported the tuple by value, so both module globals are extended.
    for module in (mcore_optimizer, distrib_optimizer):
        if key not in module.param_group_identifier_keys:
            module.param_group_identifier_keys = (*module.param_group_identifier_keys, key)


def _hold_main_parameters(optimizer) -> None:
    """Zero the lr and weight decay of every non-indexer group for this step only.

    With lr = 0 Adam's update and the decoupled weight decay are exactly zero, so the main
    model stays bit-for-bit unchanged while its moment estimates still accumulate; the scheduler
    rewrites every group's lr and weight decay after the step, so nothing needs undoing.
    """
    for group in optimizer.param_groups:
        if not group.get("msa_indexer", False):
            group["lr"] = 0.0
            group["weight_decay"] = 0.0


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token LM loss in Megatron's 3-tuple form (sum, token count, reporting)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), num_tokens.detach().float()])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(config, data_iterator, model):
    mb = next(data_iterator)
    output = model(mb.tokens, mb.position_ids, labels=mb.labels,
                   **msa_hooks.model_forward_kwargs(config, mb.packed_seq_ids))
    return output, partial(_loss_func, mb.loss_mask)


def _reduce_step_losses(losses: list[dict], device) -> dict[str, float]:
    """Sum the LM loss over microbatches and DP ranks; make it known to every rank (collective).

    Only the last pipeline stage has the losses; tensor-parallel ranks hold copies. The sum goes
    over the whole world with non-owners contributing zeros, which needs no pipeline broadcast.
    """
    from megatron.core import parallel_state as ps

    owner = (ps.is_pipeline_last_stage(ignore_virtual=True)
             and ps.get_tensor_model_parallel_rank() == 0)
    buf = torch.zeros(2, dtype=torch.float64, device=device)
    if owner:
        for d in losses:
            buf += d["lm loss"].to(buf)
    torch.distributed.all_reduce(buf)
    return {"loss": float(buf[0] / buf[1].clamp(min=1)), "tokens_in_loss": float(buf[1])}


def _count_parameters(chunks: list, device) -> int:
    """Parameters of the whole model (collective over the model-parallel group).

    Tensor-parallel shards add up; parameters replicated across TP ranks count once.
    """
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    local = sum(p.numel() for c in chunks for p in c.parameters()
                if getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
    total = torch.tensor([local], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(total, group=ps.get_model_parallel_group())
    return int(total.item())


def _output_dir(recipe: Recipe) -> Path:
    if recipe.checkpoint.save:
        return Path(recipe.checkpoint.save)
    return Path(recipe.logger.output_dir or "runs/latest")


def pretrain(recipe: Recipe) -> dict[str, Any]:
    """Train according to the recipe; return the summary (also printed on rank 0).

    Raises:
        RecipeError: a bad recipe value found while building (layout, dataset path, CPU limits).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ctx = init_distributed(recipe)
    model_section = recipe.model
    num_layers = int(model_section.get("num_layers", 1))
    dp = check_parallel_layout(model_section, ctx.world_size, recipe.train.global_batch_size,
                               recipe.train.micro_batch_size, num_layers)
    vpp = model_section.get("virtual_pipeline_model_parallel_size")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=int(model_section.get("tensor_model_parallel_size", 1)),
            pipeline_model_parallel_size=int(model_section.get("pipeline_model_parallel_size", 1)),
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=int(model_section.get("context_parallel_size", 1)),
            distributed_timeout_minutes=recipe.dist.timeout_minutes,
        )
    set_seeds(recipe.train.seed)
    config = build_config(recipe, ctx)
    chunks = wrap_ddp(recipe, config, build_model(recipe, config), ctx.device)
    optimizer, scheduler = build_optimizer(recipe, config, chunks, ctx)
    config.grad_scale_func = optimizer.scale_loss
    def per_chunk(name: str):
        funcs = [getattr(c, name) for c in chunks]
        return funcs if len(funcs) > 1 else funcs[0]

    # As Megatron-LM wires them: the schedules use these to overlap DP communication.
    config.no_sync_func = per_chunk("no_sync")
    ddp_config = chunks[0].ddp_config
    if ddp_config.overlap_grad_reduce:
        config.grad_sync_func = per_chunk("start_grad_sync")
    if ddp_config.overlap_param_gather and getattr(ddp_config, "align_param_gather", False):
        config.param_sync_func = per_chunk("start_param_sync")
    config.finalize_model_grads_func = finalize_model_grads
    msa_hooks.configure(config)
    num_params = _count_parameters(chunks, ctx.device)

    state = TrainState()
    ck = recipe.checkpoint
    load_root = ck.load or (ck.save if ck.resume else None)
    # Verified against the manifests; a damaged newest checkpoint or a lost pointer beside
    # finished iter_* directories stops here (or falls back) instead of restarting silently.
    resume_at = find_resume_iteration(load_root, fallback=ck.fallback, verify=ck.verify)
    if ck.load and resume_at is None:
        raise RecipeError(f"recipe key 'checkpoint.load' = {ck.load!r}: no finished checkpoint "
                          "there (expected latest_checkpointed_iteration.txt and iter_NNNNNNN/)")
    resumed_from = None
    if resume_at is not None:
        state = load_checkpoint(load_root, chunks, optimizer, scheduler, iteration=resume_at,
                                recipe=recipe.resolved)
        resumed_from = state.iteration

    train = recipe.train
    dataset = build_train_dataset(recipe.dataset, recipe.gpt, train.seed,
                                  train.train_iters * train.global_batch_size)
    source = MicrobatchSource(
        dataset, micro_batch_size=train.micro_batch_size,
        global_batch_size=train.global_batch_size, dp_size=dp,
        dp_rank=ps.get_data_parallel_rank(), eod_id=eod_token_id(recipe.dataset, recipe.gpt),
        device=ctx.device, consumed_samples=state.consumed_samples,
        reset_position_ids=recipe.dataset.reset_position_ids,
    )
    forward_backward = get_forward_backward_func()
    out_dir = _output_dir(recipe)
    is_rank0 = ctx.rank == 0
    metrics_log = MetricsLog(out_dir, state.iteration) if is_rank0 else None
    progress = Progress(train.train_iters, state.iteration,
                        recipe.logger.progress_bar, recipe.logger.log_interval, is_rank0)
    stop_at = train.train_iters
    if train.exit_interval:
        stop_at = min(stop_at, state.iteration + train.exit_interval)
    tokens_per_step = train.global_batch_size * recipe.gpt.seq_length
    timer = StepTimer()
    t_start = time.perf_counter()
    last_saved = resumed_from
    phase = "n/a"
    for m in chunks:
        m.train()
    while state.iteration < stop_at:
        phase = msa_hooks.set_training_phase(config, state.iteration)
        for m in chunks:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        # Every chunk of the interleaved schedule gets the very same microbatch objects (already
        # on the device), so the MSA layout built from packed_seq_ids is shared by all chunks.
        builds_before = msa_hooks.layout_builds()
        shared = SharedMicrobatchIterators(iter(source.step_microbatches()), len(chunks))
        iterators = shared.iterators()
        losses = forward_backward(
            forward_step_func=partial(_forward_step, config),
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=source.num_microbatches,
            seq_length=recipe.gpt.seq_length,
            micro_batch_size=train.micro_batch_size,
            decoder_seq_length=recipe.gpt.seq_length,
            forward_only=False,
        )
        if phase == "dense-warmup" and train.freeze_main_during_warmup:
            _hold_main_parameters(optimizer)
        ok, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        state.iteration += 1
        state.consumed_samples = source.consumed_samples
        dt = timer.lap()
        metrics = _reduce_step_losses(losses, ctx.device)
        metrics.update(msa_hooks.pop_step_metrics(config))
        if msa_hooks.is_msa_config(config):
            # This rank's MSA layouts per microbatch: 1.0 when every layer and every virtual
            # pipeline chunk shared the microbatch's layout (the per-microbatch cache works).
            metrics["layouts_per_microbatch"] = (
                (msa_hooks.layout_builds() - builds_before) / source.num_microbatches)
        metrics.update({
            "iteration": state.iteration,
            "lr": float(scheduler.get_lr(optimizer.param_groups[0])),
            "step_time_s": dt,
            "tokens_per_s": tokens_per_step / max(dt, 1e-9),
            "phase": phase,
            "skipped": not ok,
        })
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError(
                f"loss is {metrics['loss']} at iteration {state.iteration}; the last finished "
                f"checkpoint ({last_saved}) is intact"
            )
        state.history.append({k: v for k, v in metrics.items()
                              if k in ("iteration", "loss", "indexer_loss", "recall", "lr")})
        if is_rank0:
            metrics_log.write(metrics)
        progress.update(metrics)
        if ck.save and ck.save_interval and state.iteration % ck.save_interval == 0:
            save_checkpoint(ck.save, chunks, optimizer, scheduler, state, recipe.resolved,
                            ck.keep_last)
            last_saved = state.iteration
    progress.close()
    if ck.save and last_saved != state.iteration and state.iteration > (resumed_from or 0):
        save_checkpoint(ck.save, chunks, optimizer, scheduler, state, recipe.resolved,
                        ck.keep_last)
        last_saved = state.iteration

    elapsed = time.perf_counter() - t_start
    hist = state.history
    steps_run = state.iteration - (resumed_from or 0)
    summary: dict[str, Any] = {
        "recipe": recipe.source,
        "attention": "MSA" if msa_hooks.is_msa_config(config) else "dense (local GPT spec)",
        "parameters": f"{num_params / 1e6:.2f}M",
        "world size": ctx.world_size,
        "layout TPxPPxVPPxDP": f"{config.tensor_model_parallel_size}x"
                               f"{config.pipeline_model_parallel_size}x{vpp or 1}x{dp}",
        "steps": f"{state.iteration}/{train.train_iters}"
                 + (f" (resumed at {resumed_from})" if resumed_from else ""),
        "first loss": hist[0]["loss"] if hist else float("nan"),
        "final loss": hist[-1]["loss"] if hist else float("nan"),
        "tokens/s": steps_run * tokens_per_step / elapsed if steps_run else 0.0,
        "wall time s": elapsed,
        "last phase": phase,
    }
    if msa_hooks.dense_warmup_steps(config):
        summary["dense warm-up steps"] = msa_hooks.dense_warmup_steps(config)
    if hist and "indexer_loss" in hist[-1]:
        summary["final indexer loss"] = hist[-1]["indexer_loss"]
    if hist and "recall" in hist[-1]:
        summary["final recall"] = hist[-1]["recall"]
    if ck.save:
        summary["checkpoint"] = str(ck.save) + (f"/iter_{last_saved:07d}" if last_saved else "")
    summary["metrics"] = str(out_dir / "metrics.jsonl")
    if is_rank0 and recipe.logger.plot and hist:
        png = plot_loss_curve(hist, out_dir / "loss_curve.png", Path(recipe.source).stem,
                              msa_hooks.dense_warmup_steps(config))
        if png is not None:
            summary["loss curve"] = str(png)
    if is_rank0:
        print(format_summary(summary), flush=True)
    summary["history"] = hist
    return summary


def teardown() -> None:
    """Undo what :func:`pretrain` set up in this process (parallel state, group, CPU shim).

    A process group or shim that existed before ``pretrain`` was called is left alone.
    """
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if _OWNED["process_group"] and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if _OWNED["cpu_shim"]:
        cpu_shim.uninstall()
        cpu_extras.uninstall()
    _OWNED.update(process_group=False, cpu_shim=False)


__all__ = ["pretrain", "teardown", "RunContext"]
