"""The pretraining entry: :func:`pretrain` runs a recipe from set-up to summary; :func:`teardown`.

``pretrain`` is what ``scripts/pretrain.py`` runs, in this order: set up the process group, the
model-parallel groups and the seeds (:mod:`nemo_msa.training.setup`); build the config, the
DDP-wrapped model chunks, the optimizer and the scheduler (:mod:`nemo_msa.training.build`);
resume from the newest finished checkpoint (:mod:`nemo_msa.training.checkpoint`); open the data
at the resumed position; run the steps (:mod:`nemo_msa.training.loop`); then print the summary
and plot the loss curve.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nemo_msa.megatron.config import normalize_layer_pattern
from nemo_msa.training.build import TrainingObjects, build_microbatch_source, build_training
from nemo_msa.training.checkpoint import (
    TrainState,
    load_checkpoint,
    warn_on_suspicious_parameters,
)
from nemo_msa.training.checkpoint_integrity import (
    checkpoint_name,
    find_resume_iteration,
    finished_iterations_everywhere,
)
from nemo_msa.training.checkpoint_lock import CheckpointLock, acquire_on_rank0, release
from nemo_msa.training.loop import LoopResult, run_steps
from nemo_msa.training.recipe import Recipe, RecipeError
from nemo_msa.training.recipe_changes import check_recipe_changes
from nemo_msa.training.setup import (
    RunContext,
    init_distributed,
    init_model_parallel,
    set_seeds,
    teardown,
)
from nemo_msa.training.ux import format_summary, plot_loss_curve


def _output_dir(recipe: Recipe) -> Path:
    if recipe.checkpoint.save:
        return Path(recipe.checkpoint.save)
    return Path(recipe.logger.output_dir or "runs/latest")


def _make_directories(recipe: Recipe) -> None:
    """Create the directories the run writes to besides the checkpoint's, before anything runs.

    Raises:
        RecipeError: naming ``logger.output_dir`` (where the metrics and the plot go when
            ``checkpoint.save`` is not set) or ``dataset.path_to_cache``, the path and why it
            cannot be created or written to.
    """
    wanted = [("dataset.path_to_cache", recipe.dataset.path_to_cache)]
    if not recipe.checkpoint.save:
        wanted.append(("logger.output_dir", str(_output_dir(recipe))))
    for key, path in wanted:
        if path is None:
            continue
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RecipeError(f"recipe key '{key}' = {path!r}: cannot create the directory "
                              f"({err.strerror or err}: {err.filename or path!r}); expected a "
                              "directory this run can create and write to") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise RecipeError(f"recipe key '{key}' = {path!r}: the directory is not writable by "
                              "this user; expected a directory this run can write to")


def _resume(recipe: Recipe, objs: TrainingObjects, rank: int) -> tuple[TrainState, int | None]:
    """Load the checkpoint the recipe resumes from, if any; collective.

    The recipe keys that differ from the checkpoint's recipe are printed in one block (rank 0);
    those that change the model or the data order stop a training run unless
    ``checkpoint.allow_recipe_change`` (:mod:`nemo_msa.training.recipe_changes`).

    Returns:
        The training state to continue from and the iteration resumed at (None: fresh start).

    Raises:
        RecipeError: ``checkpoint.load`` names a directory without a finished checkpoint, or
            ``checkpoint.save`` holds finished checkpoints this run did not resume from (they
            would be overwritten) and ``checkpoint.overwrite`` is false, or a key that changes
            the model or the data order differs from the checkpoint's recipe.
        CheckpointError: the checkpoint to resume from is damaged (no fallback taken) or
            Megatron cannot load it.
    """
    ck = recipe.checkpoint
    load_root = ck.load or (ck.save if ck.resume else None)
    # Verified against the manifests; a damaged newest checkpoint or a lost pointer beside
    # finished iter_* directories stops here (or falls back) instead of restarting silently.
    resume_at = find_resume_iteration(load_root, fallback=ck.fallback, verify=ck.verify)
    if ck.load and resume_at is None:
        raise RecipeError(f"recipe key 'checkpoint.load' = {ck.load!r}: no finished checkpoint "
                          "there (expected latest_checkpointed_iteration.txt and iter_NNNNNNN/)")
    resumed_from_save = resume_at is not None and ck.save is not None and (
        Path(load_root).resolve() == Path(ck.save).resolve())
    if ck.save is not None and not resumed_from_save and not ck.overwrite:
        existing = finished_iterations_everywhere(ck.save)
        if existing:
            why = ("checkpoint.resume=false" if not ck.resume and not ck.load
                   else f"the run starts from {load_root}")
            raise RecipeError(
                f"recipe key 'checkpoint.save' = {ck.save!r} holds finished checkpoints "
                f"(iterations {', '.join(map(str, existing))}) that this run did not resume "
                f"from ({why}) and would overwrite; resume from them, save elsewhere, or set "
                "checkpoint.overwrite=true")
    if resume_at is None:
        return TrainState(), None

    def compare(saved: dict | None, path: Path) -> None:
        check_recipe_changes(saved, recipe.resolved, path, training=not recipe.train.skip_train,
                             allowed=ck.allow_recipe_change, rank=rank)

    state = load_checkpoint(load_root, objs.chunks, objs.optimizer, objs.scheduler,
                            iteration=resume_at, recipe=recipe.resolved, on_saved_recipe=compare)
    if not ck.verify:
        warn_on_suspicious_parameters(objs.chunks, checkpoint_name(load_root, resume_at))
    return state, state.iteration


def _attention(objs: TrainingObjects) -> str:
    """What the layers attend with: ``MSA``, or with a layer pattern how many layers are MSA
    (a pattern without ``S`` is the dense baseline)."""
    if not objs.hooks.msa:
        return "dense (local GPT spec)"
    config = objs.config
    pattern = getattr(config, "msa_layer_pattern", None)
    if pattern is None:
        return "MSA"
    flags = normalize_layer_pattern(pattern, config.num_layers)
    return (f"MSA in {sum(flags)} of {len(flags)} layers (pattern "
            f"{''.join('S' if f else 'D' for f in flags)})")


def _summary(recipe: Recipe, ctx: RunContext, objs: TrainingObjects, dp: int, state: TrainState,
             resumed_from: int | None, result: LoopResult, out_dir: Path) -> dict[str, Any]:
    """The end-of-run summary (what :func:`pretrain` prints), without the history."""
    config, train, ck = objs.config, recipe.train, recipe.checkpoint
    hist = state.history
    steps_run = state.iteration - (resumed_from or 0)
    tokens_per_step = train.global_batch_size * recipe.gpt.seq_length
    vpp = recipe.model.get("virtual_pipeline_model_parallel_size")
    summary: dict[str, Any] = {
        "recipe": recipe.source,
        "attention": _attention(objs),
        "parameters": f"{objs.num_params / 1e6:.2f}M",
        "world size": ctx.world_size,
        "layout TPxPPxVPPxDP": f"{config.tensor_model_parallel_size}x"
                               f"{config.pipeline_model_parallel_size}x{vpp or 1}x{dp}",
        "context parallel": config.context_parallel_size,
        "steps": f"{state.iteration}/{train.train_iters}"
                 + (f" (resumed at {resumed_from})" if resumed_from else ""),
        "first loss": hist[0]["loss"] if hist else float("nan"),
        "final loss": hist[-1]["loss"] if hist else float("nan"),
        # The MTP loss beside the LM loss (Megatron's mtp_1 loss, mean over depths).
        **({"final MTP loss": hist[-1]["mtp_loss"]} if hist and "mtp_loss" in hist[-1] else {}),
        "tokens/s": (steps_run * tokens_per_step / (result.elapsed - result.eval_seconds)
                     if steps_run else 0.0),
        "wall time s": result.elapsed,
        "last phase": result.phase,
    }
    if objs.hooks.dense_warmup_steps:
        summary["dense warm-up steps"] = objs.hooks.dense_warmup_steps
    if hist and "indexer_loss" in hist[-1]:
        summary["final indexer loss"] = hist[-1]["indexer_loss"]
    if hist and "recall" in hist[-1]:
        summary["final recall"] = hist[-1]["recall"]
    summary.update(result.flops_summary or {})
    for key, value in (result.last_eval or {}).items():
        if key.startswith("probe/") and key.count("/") > 1:
            continue  # per-bucket probe values: metrics.jsonl; the summary keeps the overall ones
        summary[key.replace("val_loss/", "val loss ").replace("_", " ")] = value
    if ck.save:
        last = result.last_saved
        summary["checkpoint"] = str(ck.save) + (f"/iter_{last:07d}" if last else "")
    summary["metrics"] = str(out_dir / "metrics.jsonl")
    return summary


def pretrain(recipe: Recipe) -> dict[str, Any]:
    """Train according to the recipe; return the summary (also printed on rank 0).

    Returns:
        The summary's entries plus ``history``, one dict of metrics per step of the run.

    Raises:
        RecipeError: a bad recipe value found while building (layout, dataset path, CPU limits),
            or an output or cache directory that cannot be created.
        CheckpointError: the checkpoint to resume from is damaged or cannot be loaded, or a save
            failed (disk full, ...).
        CheckpointLockError: another run holds ``checkpoint.save``, or took it over from this
            one (which it judged gone).
    """
    _make_directories(recipe)
    ctx = init_distributed(recipe)
    # Before anything reads checkpoint.save: one writer per directory (ADR 0024); a lock whose
    # holder is provably gone is taken over (ADR 0049).
    lock = acquire_on_rank0(recipe.checkpoint.save, recipe.checkpoint.lock_stale_s)
    try:
        return _locked_pretrain(recipe, ctx, lock)
    finally:
        release(lock)


def _locked_pretrain(recipe: Recipe, ctx: RunContext,
                     lock: CheckpointLock | None) -> dict[str, Any]:
    """:func:`pretrain` after the process group is up and the checkpoint directory locked."""
    dp = init_model_parallel(recipe, ctx)
    set_seeds(recipe.train.seed)
    objs = build_training(recipe, ctx)
    state, resumed_from = _resume(recipe, objs, ctx.rank)
    source = build_microbatch_source(recipe, ctx, dp, state.consumed_samples)
    out_dir = _output_dir(recipe)
    result = run_steps(recipe, ctx, objs, source, state, resumed_from, out_dir, lock)
    summary = _summary(recipe, ctx, objs, dp, state, resumed_from, result, out_dir)
    hist = state.history
    is_rank0 = ctx.rank == 0
    if is_rank0 and recipe.logger.plot and hist:
        png = plot_loss_curve(hist, out_dir / "loss_curve.png", Path(recipe.source).stem,
                              objs.hooks.dense_warmup_steps)
        if png is not None:
            summary["loss curve"] = str(png)
    if is_rank0:
        print(format_summary(summary), flush=True)
    summary["history"] = hist
    return summary


__all__ = ["RunContext", "pretrain", "teardown"]
