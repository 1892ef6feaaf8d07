"""The step loop: forward/backward by Megatron's schedule, optimizer step, metrics, checkpoints.

:func:`run_steps` runs ``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved, as
the layout asks) one global batch at a time, with the MSA phase switch before each step; after
each step it reduces the LM loss over the microbatches and data-parallel ranks, writes the
metrics log, moves the progress bar and saves a checkpoint at the save interval.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from nemo_msa.megatron.microbatch import SharedMicrobatchIterators
from nemo_msa.training.build import TrainingObjects
from nemo_msa.training.checkpoint import TrainState, save_checkpoint
from nemo_msa.training.checkpoint_integrity import checkpoint_name, verify_checkpoint
from nemo_msa.training.checkpoint_lock import CheckpointLock, CheckpointLockError
from nemo_msa.training.checkpoint_lock import check as check_lock
from nemo_msa.training.data import Microbatch, MicrobatchSource, schedule_shape
from nemo_msa.training.evaluate import Evaluator, StepFlops, should_exit
from nemo_msa.training.msa_hooks import TrainingHooks
from nemo_msa.training.recipe import Recipe
from nemo_msa.training.setup import RunContext
from nemo_msa.training.ux import MetricsLog, Progress, StepTimer


@dataclass
class LoopResult:
    """How the loop ended (the training state itself is updated in place)."""

    #: The MSA phase of the last step ("n/a" when no step ran).
    phase: str
    #: The iteration of the newest checkpoint this run saved or resumed from (None: neither).
    last_saved: int | None
    #: Seconds from the first step to the end of the final save.
    elapsed: float
    #: Of ``elapsed``, the seconds spent evaluating.
    eval_seconds: float = 0.0
    #: Mean TFLOP/s per GPU and MFU over the run's steps (:class:`StepFlops`).
    flops_summary: dict | None = None
    #: The last evaluation's metrics (empty without evaluation).
    last_eval: dict | None = None


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


def _loss_func(mb: Microbatch, per_token: bool, output_tensor: torch.Tensor):
    """Per-token LM loss in Megatron's 3-tuple form (sum, token count, reporting).

    The report is this rank's loss sum and loss-token count (summed over every rank after the
    step). What goes to the schedule depends on the normalisation:

    - ``config.calculate_per_token_loss``: the local sum and count (Megatron's convention:
      finalize_model_grads all-reduces the count over DP x CP and divides the summed gradients);
    - otherwise (the default) the schedule divides by the count, and DDP averages gradients over
      DP x CP. Each CP rank then returns ``N x`` its local sum with the *global* count of the
      microbatch, so that the average over the N CP ranks is the microbatch's mean loss exactly
      as at CP = 1, whatever share of loss tokens each rank holds.
    """
    losses = output_tensor.float().view(-1)
    mask = mb.loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    local_tokens = mask.sum()
    report = torch.stack([loss.detach(), local_tokens.detach()])
    if per_token or mb.cp_size == 1:
        return loss, local_tokens.to(torch.int), {"lm loss": report}
    return loss * mb.cp_size, mb.loss_tokens.to(torch.int), {"lm loss": report}


def _forward_step(hooks: TrainingHooks, per_token: bool, data_iterator, model):
    mb = next(data_iterator)
    output = model(**hooks.forward_arguments(mb))
    return output, partial(_loss_func, mb, per_token)


def _reduce_step_losses(losses: list[dict], device,
                        lock_lost: bool = False) -> tuple[dict[str, float], bool]:
    """Sum the LM loss over microbatches, DP and CP ranks; make it known to every rank (collective).

    Only the last pipeline stage has the losses; tensor-parallel ranks hold copies; each
    context-parallel rank holds the sum and count of its share of the tokens. The sum goes over
    the whole world with non-owners contributing zeros, which needs no pipeline broadcast. Rank
    0's word that the checkpoint lock is no longer this run's rides along in the same reduction.

    Returns:
        The loss metrics, and whether any rank reported the lock lost.
    """
    owner = (ps.is_pipeline_last_stage(ignore_virtual=True)
             and ps.get_tensor_model_parallel_rank() == 0)
    buf = torch.zeros(3, dtype=torch.float64, device=device)
    if owner:
        for d in losses:
            buf[:2] += d["lm loss"].to(buf)
    buf[2] = float(lock_lost)
    torch.distributed.all_reduce(buf)
    metrics = {"loss": float(buf[0] / buf[1].clamp(min=1)), "tokens_in_loss": float(buf[1])}
    return metrics, bool(buf[2] > 0)


def _last_checkpoint(root: str | None, iteration: int | None) -> str:
    """What the last finished checkpoint is worth after a failure, checked now (collective).

    It is verified against its manifest here, whatever ``checkpoint.verify`` said at resume: a
    checkpoint resumed unverified may be the very cause of the failure.
    """
    if iteration is None or root is None:
        return "no checkpoint was saved or resumed from"
    path = checkpoint_name(root, iteration)
    problems = verify_checkpoint(path)
    if not problems:
        return (f"the last finished checkpoint ({path}) is intact (verified against its "
                "manifest)")
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return f"the last finished checkpoint ({path}) is damaged: {problems[0]}{more}"


def run_steps(recipe: Recipe, ctx: RunContext, objs: TrainingObjects, source: MicrobatchSource,
              state: TrainState, resumed_from: int | None, out_dir: Path,
              lock: CheckpointLock | None = None) -> LoopResult:
    """Train from ``state.iteration`` to the end of the schedule (or ``train.exit_interval``).

    ``state`` advances in place (iteration, consumed samples, one history entry per step). A
    checkpoint is saved every ``checkpoint.save_interval`` steps and once at the end when the
    last step is not saved yet. After every step rank 0 checks that ``lock`` (its lock of
    ``checkpoint.save``) is still this run's.

    Raises:
        FloatingPointError: the loss is not finite (naming the last finished checkpoint and
            whether it matches its manifest, checked then).
        CheckpointError: a save failed (the path and the cause).
        CheckpointLockError: the lock file was deleted or taken over by another run (which
            judged this one gone); raised before this run writes the step's metrics or a
            checkpoint.
    """
    chunks, optimizer, scheduler = objs.chunks, objs.optimizer, objs.scheduler
    hooks = objs.hooks
    train, ck = recipe.train, recipe.checkpoint
    forward_backward = get_forward_backward_func()
    forward_step = partial(_forward_step, hooks, bool(objs.config.calculate_per_token_loss))
    is_rank0 = ctx.rank == 0
    metrics_log = MetricsLog(out_dir, state.iteration) if is_rank0 else None
    progress = Progress(train.train_iters, state.iteration,
                        recipe.logger.progress_bar, recipe.logger.log_interval, is_rank0)
    stop_at = train.train_iters
    if train.exit_interval:
        stop_at = min(stop_at, state.iteration + train.exit_interval)
    tokens_per_step = train.global_batch_size * recipe.gpt.seq_length
    seq_length, micro_batch_size = schedule_shape(recipe.gpt.seq_length, train.micro_batch_size,
                                                  recipe.dataset.packed_format)
    evaluator = Evaluator(recipe, ctx, hooks, chunks, forward_backward,
                          ps.get_data_parallel_world_size())
    step_flops = StepFlops(recipe, objs.config, ctx.device)
    train_seconds = 0.0
    last_eval: dict = {}
    timer = StepTimer()
    t_start = time.perf_counter()
    last_saved = resumed_from
    # Where last_saved lives: the directory resumed from until this run saves.
    last_root = (ck.load or ck.save) if resumed_from is not None else None
    phase = "n/a"
    if train.skip_train:  # Megatron's --skip-train: one evaluation of the model as loaded
        # The phase of the loaded model's last step, as an evaluation during training sees it
        # (a fresh process knows no iteration, and an MSA layer refuses to guess its phase).
        phase = hooks.set_training_phase(max(state.iteration - 1, 0))
        if evaluator.enabled:
            last_eval = evaluator.run(state.iteration)
            if is_rank0:
                metrics_log.write({"iteration": state.iteration, "skip_train": True,
                                   **last_eval})
        progress.close()
        return LoopResult(phase, last_saved, time.perf_counter() - t_start, evaluator.seconds,
                          {}, last_eval)
    for m in chunks:
        m.train()
    while state.iteration < stop_at:
        phase = hooks.set_training_phase(state.iteration)
        for m in chunks:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        # Every chunk of the interleaved schedule gets the very same microbatch objects (already
        # on the device), so the MSA layout built from packed_seq_ids is shared by all chunks.
        builds_before = hooks.layout_builds()
        microbatches = source.step_microbatches()
        shared = SharedMicrobatchIterators(iter(microbatches), len(chunks))
        iterators = shared.iterators()
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=source.num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=seq_length,
            forward_only=False,
        )
        if phase == "dense-warmup" and train.freeze_main_during_warmup:
            _hold_main_parameters(optimizer)
        ok, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        state.iteration += 1
        state.consumed_samples = source.consumed_samples
        dt = timer.lap()
        metrics, lock_lost = _reduce_step_losses(losses, ctx.device,
                                                 check_lock(lock) is not None)
        if lock_lost:
            raise CheckpointLockError(
                f"the lock of checkpoint directory {ck.save} was deleted or taken over by "
                f"another run (which judged this one gone, e.g. after its heartbeat stalled "
                f"for checkpoint.lock_stale_s): this run stopped after iteration "
                f"{state.iteration} without writing it, so that one run writes there at a time")
        metrics.update(hooks.pop_step_metrics(source.num_microbatches, ctx.device))
        if builds_before is not None:
            # This rank's MSA layouts per microbatch: 1.0 when every layer and every virtual
            # pipeline chunk shared the microbatch's layout (the per-microbatch cache works).
            metrics["layouts_per_microbatch"] = (
                (hooks.layout_builds() - builds_before) / source.num_microbatches)
        metrics.update({
            "iteration": state.iteration,
            "lr": float(scheduler.get_lr(optimizer.param_groups[0])),
            "step_time_s": dt,
            "tokens_per_s": tokens_per_step / max(dt, 1e-9),
            "phase": phase,
            "skipped": not ok,
        })
        train_seconds += dt
        metrics.update(step_flops.metrics(step_flops.count(microbatches, phase), dt))
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError(
                f"loss is {metrics['loss']} at iteration {state.iteration}; "
                f"{_last_checkpoint(last_root, last_saved)}"
            )
        stopping = should_exit(t_start, train.exit_duration_in_mins, ctx.device)
        if evaluator.due(state.iteration) or (
                (stopping or state.iteration == stop_at) and evaluator.final_due(state.iteration)):
            last_eval = evaluator.run(state.iteration)
            metrics.update(last_eval)
            timer.lap()  # the evaluation is not the next step's time
        state.history.append({k: v for k, v in metrics.items()
                              if k in ("iteration", "loss", "mtp_loss", "indexer_loss",
                                       "recall", "lr", "val_loss")})
        if is_rank0:
            metrics_log.write(metrics)
        progress.update(metrics)
        if ck.save and ck.save_interval and state.iteration % ck.save_interval == 0:
            save_checkpoint(ck.save, chunks, optimizer, scheduler, state, recipe.resolved,
                            ck.keep_last)
            last_saved, last_root = state.iteration, ck.save
        if stopping:
            break
    progress.close()
    if ck.save and last_saved != state.iteration and state.iteration > (resumed_from or 0):
        save_checkpoint(ck.save, chunks, optimizer, scheduler, state, recipe.resolved,
                        ck.keep_last)
        last_saved = state.iteration
    return LoopResult(phase, last_saved, time.perf_counter() - t_start, evaluator.seconds,
                      step_flops.summary(train_seconds), last_eval)


__all__ = ["LoopResult", "run_steps"]
