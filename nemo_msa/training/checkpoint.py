"""Checkpoint save and resume with Megatron dist-checkpointing, made atomic.

A save writes into ``iter_N.partial`` and only after every rank has finished (barrier) and the
manifest is written (:func:`nemo_msa.training.checkpoint_integrity.write_manifest`) does rank 0
rename it to ``iter_N`` and then replace the pointer file (write a temp file, fsync,
``os.replace``). A crash at any point leaves either the old pointer or a complete new checkpoint;
a stale ``.partial`` directory is never read and is removed by the next save. Which directories
are finished or intact, and which one a run resumes from, is decided in
:mod:`nemo_msa.training.checkpoint_integrity`.

Contents: the model chunks (``model`` or ``model0``, ``model1``, ... with virtual pipelining, as
Megatron-LM names them), the optimizer (sharded from the model's state dict, so it reshards with
the model), the scheduler, the RNG states (one ShardedObject per pipeline x tensor rank) and the
training state (iteration, consumed samples, the loss history for the plot, the recipe).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from nemo_msa.training.checkpoint_integrity import (
    POINTER,
    CheckpointError,
    checkpoint_name,
    find_resume_iteration,
    write_manifest,
)
from nemo_msa.training.recipe_changes import differences
from nemo_msa.training.recipe_fields import RecipeError
from nemo_msa.training.save_failures import (
    WriterLog,
    agreed_save_step,
    previous_checkpoint,
)

logger = logging.getLogger(__name__)


#: What Megatron's loading raises on a bad checkpoint; torch's CheckpointException is a
#: BaseException, which ``except Exception`` would let through.
_LOAD_ERRORS = (Exception, CheckpointException)


@dataclass
class TrainState:
    """What the loop needs to continue exactly where it stopped."""

    iteration: int = 0
    consumed_samples: int = 0
    #: One dict of metrics per finished step (loss, indexer loss, recall, lr, ...).
    history: list[dict[str, float]] = field(default_factory=list)


def _rng_state() -> dict[str, Any]:
    state = {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _layout() -> tuple[int, int, int, int]:
    return (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())


def _unwrap(model_chunks) -> list:
    """The GPT modules inside DDP / Float16Module, whose keys match Megatron-LM checkpoints."""
    return [unwrap_model(m) for m in model_chunks]


def sharded_state_dict(model_chunks, optimizer, scheduler, state: TrainState | None,
                       recipe: dict | None, is_loading: bool) -> dict[str, Any]:
    """Build the dist-checkpointing state dict of the whole training state on this rank."""
    model_chunks = _unwrap(model_chunks)

    sd: dict[str, Any] = {}
    if len(model_chunks) == 1:
        sd["model"] = model_chunks[0].sharded_state_dict()
    else:
        for i, chunk in enumerate(model_chunks):
            sd[f"model{i}"] = chunk.sharded_state_dict()
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading)
    sd["scheduler"] = scheduler.state_dict()
    pp, tp, pp_rank, tp_rank = _layout()
    # RNG differs per pipeline and tensor rank and is replicated over data parallel (every DP
    # rank is seeded alike), which is how Megatron-LM shards it.
    sd["rng_state"] = ShardedObject(
        "rng_state", _rng_state(), (pp, tp), (pp_rank, tp_rank),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )
    sd["train_state"] = {
        "iteration": state.iteration if state else 0,
        "consumed_samples": state.consumed_samples if state else 0,
        "history": list(state.history) if state else [],
        "layout": [pp, tp],
    }
    sd["recipe"] = recipe or {}
    return sd


def _rss_bytes() -> int:
    """Resident memory of this process from /proc (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _ensure_memory_probe() -> None:
    """Let dist-checkpointing's writer run without psutil.

    Megatron-Core's filesystem writer measures its memory before/after writing only for a debug
    log line, but raises when psutil (not a megatron-core dependency) is missing, which fails
    every save. Without psutil we hand it a /proc reader; with psutil nothing changes.
    """
    if not getattr(filesystem_async, "HAVE_PSUTIL", True):
        filesystem_async._process_memory = _rss_bytes


@contextlib.contextmanager
def _write_results_in_this_process():
    """Let dist-checkpointing's writer hand its results on through a queue of this process.

    Its file writer passes them through ``multiprocessing.Manager().Queue()``, made for the
    asynchronous save, where another process writes: a spawned server process plus
    multiprocessing's resource tracker, both of which outlive a SIGKILLed trainer. These saves
    are synchronous (the writer runs in this process, ``AsyncRequest.execute_sync``), so a
    ``queue.Queue`` carries the same results with no process at all. A queue made before (an
    asynchronous save elsewhere in this process) is left in use.
    """
    before = filesystem_async._results_queue
    if before is None:
        filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = before


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _write_pointer(root: Path, iteration: int) -> None:
    tmp = root / (POINTER + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(f"{iteration}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / POINTER)


def save_checkpoint(root: str | os.PathLike, model_chunks, optimizer, scheduler,
                    state: TrainState, recipe: dict | None = None,
                    keep_last: int | None = None) -> Path:
    """Save the training state atomically (see the module docstring); collective.

    Returns:
        The finished checkpoint directory.

    Raises:
        CheckpointError: an OSError on any rank (disk full, quota, permissions, I/O error), on
            every rank: names the path, the cause ("No space left on device (errno 28 ENOSPC)")
            and that the previous checkpoint and pointer are unchanged; the ``.partial``
            directory is removed to give the space back.
        Exception: any other failure of a step, re-raised on its rank after the same cleanup;
            the other ranks raise CheckpointError naming that rank and the error (instead of
            waiting for it until the process group's timeout).
    """
    _ensure_memory_probe()
    root = Path(root)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    final = checkpoint_name(root, state.iteration)
    partial = final.with_name(final.name + ".partial")
    writer = WriterLog()
    writer_logger = logging.getLogger(filesystem_async.__name__)

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        # Leftovers of an interrupted save of this iteration are never trusted.
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()

    def write() -> None:
        sd = sharded_state_dict(model_chunks, optimizer, scheduler, state, recipe,
                                is_loading=False)
        # The writer's error lines are collected here, not printed: a failed save is reported
        # as one line that quotes them (or, for a cause not recognized, as notes on the error).
        writer_logger.addHandler(writer)
        propagate, writer_logger.propagate = writer_logger.propagate, False
        try:
            with _write_results_in_this_process():
                dist_checkpointing.save(sd, str(partial))
        finally:
            writer_logger.removeHandler(writer)
            writer_logger.propagate = propagate

    def publish() -> None:
        if final.exists():
            # Re-saving an iteration (e.g. after a resume): drop the older copy only now that
            # the new one is complete; the pointer still names it until os.replace below.
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        _write_pointer(root, state.iteration)

    steps = [(prepare, partial, True), (write, partial, False),
             (lambda: write_manifest(partial, state.iteration), partial, False),
             (publish, root, True)]
    for action, where, rank0_only in steps:
        failure, error = agreed_save_step(action, where, writer.messages,
                                          rank == 0 or not rank0_only)
        if failure is not None:
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
                (root / (POINTER + ".tmp")).unlink(missing_ok=True)
                failure += f"; {previous_checkpoint(root)}"
            if error is not None:
                raise error  # not a file-system failure: its own traceback, after the cleanup
            raise CheckpointError(
                f"saving checkpoint iteration {state.iteration} to {root} failed: {failure}")
    if rank == 0 and keep_last:
        finished = sorted(p for p in root.glob("iter_???????") if p.is_dir())
        for old in finished[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


#: The schedule fields Megatron's scheduler checks when it loads (its ``_check_and_set``): the
#: scheduler attribute, the checkpoint's names for it (older ones first) and the recipe key
#: that sets it (None: decided in :func:`_schedule_key`).
_SCHEDULE_FIELDS = (
    ("max_lr", ("start_lr", "max_lr"), "optimizer.lr"),
    ("min_lr", ("min_lr",), "optimizer.min_lr"),
    ("lr_warmup_steps", ("warmup_iter", "warmup_steps", "lr_warmup_steps"),
     "scheduler.lr_warmup_iters"),
    ("lr_decay_steps", ("end_iter", "decay_steps", "lr_decay_steps"), None),
    ("lr_decay_style", ("decay_style", "lr_decay_style"), "scheduler.lr_decay_style"),
    ("start_wd", ("start_wd",), None),
    ("end_wd", ("end_wd",), None),
    ("wd_incr_steps", ("wd_incr_steps",), "train.train_iters"),
    ("wd_incr_style", ("wd_incr_style",), "scheduler.weight_decay_incr_style"),
)


def _schedule_key(attribute: str, recipe: dict | None) -> str:
    """The recipe key behind a scheduler field whose key depends on what the recipe sets."""
    scheduler = (recipe or {}).get("scheduler") or {}
    if attribute == "lr_decay_steps":
        return ("scheduler.lr_decay_iters" if scheduler.get("lr_decay_iters")
                else "train.train_iters")
    name = "start_weight_decay" if attribute == "start_wd" else "end_weight_decay"
    return f"scheduler.{name}" if scheduler.get(name) is not None else "optimizer.weight_decay"


def _check_schedule(saved: dict, scheduler, path, recipe: dict | None) -> None:
    """Refuse a schedule that differs from the checkpoint's unless a scheduler flag decides.

    Megatron's scheduler asserts equal values while it loads; checked here first, before
    anything is loaded, so that the refusal names the recipe keys, both values and the flags.

    Raises:
        RecipeError: a value differs and neither ``scheduler.override_opt_param_scheduler`` nor
            ``scheduler.use_checkpoint_opt_param_scheduler`` is set.
    """
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return
    differ: dict[str, tuple] = {}
    for attribute, names, key in _SCHEDULE_FIELDS:
        name = next((n for n in names if n in saved), None)
        now = getattr(scheduler, attribute)
        if name is None or saved[name] == now:
            continue
        differ.setdefault(key or _schedule_key(attribute, recipe), (now, saved[name]))
    if not differ:
        return
    flags = ("scheduler.override_opt_param_scheduler=true to train on with the recipe's {0}, "
             "or scheduler.use_checkpoint_opt_param_scheduler=true to keep the checkpoint's")
    if len(differ) == 1:
        (key, (now, was)), = differ.items()
        raise RecipeError(f"recipe key '{key}' = {now!r} but checkpoint {path} was trained with "
                          f"{was!r}: pass {flags.format('value')}")
    listed = ", ".join(f"'{k}' = {now!r} (checkpoint: {was!r})" for k, (now, was) in differ.items())
    raise RecipeError(f"recipe keys {listed} differ from the schedule checkpoint {path} was "
                      f"trained with: pass {flags.format('values')}")


def _reconcile_learning_rates(saved: dict, scheduler) -> dict[str, tuple[float, ...]]:
    """The max/min lr to load the checkpoint with and to train with (after
    :func:`_check_schedule`).

    Returns:
        ``{"max_lr": (recipe, saved, chosen), "min_lr": (recipe, saved, chosen)}``.
    """
    result = {}
    for name in ("max_lr", "min_lr"):
        now = float(getattr(scheduler, name))
        was = float(saved.get("start_lr" if name == "max_lr" and "start_lr" in saved else name,
                              now))
        result[name] = (now, was, was if scheduler.use_checkpoint_opt_param_scheduler else now)
    return result


def _set_group_lrs(optimizer, lrs: dict[str, tuple[float, ...]], to_saved: bool) -> None:
    """Point the param groups' max/min lr at the checkpoint's values (to match its group
    names while loading) or at the chosen ones (to train with). Only groups that carry the
    recipe's (or, after loading, the checkpoint's) value are touched."""
    for group in optimizer.param_groups:
        for name, (now, was, chosen) in lrs.items():
            if to_saved and group.get(name) == now:
                group[name] = was
            elif not to_saved and group.get(name) == was:
                group[name] = chosen


def _describe(exc: BaseException) -> str:
    """One line for an exception; torch's CheckpointException by its ranks' own errors."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {_describe(inner)}")
        return "; ".join(parts)
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _megatron_error(path: Path, exc: BaseException, saved_recipe: dict | None,
                    recipe: dict | None) -> CheckpointError:
    """Wrap an error raised inside Megatron's loading with the path and what to do."""
    diff = [d.key for d in differences(saved_recipe, recipe) if d.key.startswith("model.")]
    if diff:
        cause = (f"It was saved with another model ({', '.join(diff)} "
                 f"{'differs' if len(diff) == 1 else 'differ'} from this recipe): run with the "
                 "checkpoint's model settings")
    else:
        cause = ("If the model, parallel layout or code changed since the save, run with the "
                 "checkpoint's; with checkpoint.verify=false a damaged file also fails here "
                 "(verification names it)")
    return CheckpointError(
        f"loading checkpoint {path} failed inside Megatron dist-checkpointing "
        f"({_describe(exc)}). {cause}; or set another checkpoint.save to start from scratch"
    )


#: A loaded parameter with a value beyond this magnitude is named in a warning: trained weights
#: stay orders of magnitude below it, a damaged file's reinterpreted bytes often do not.
ABSURD_MAGNITUDE = 1e4


def suspicious_parameters(model_chunks) -> list[tuple[str, float]]:
    """This rank's parameters holding a non-finite value or one above :data:`ABSURD_MAGNITUDE`.

    Returns:
        ``(name, largest magnitude)`` per such parameter (``inf`` for a non-finite value), in
        the order of ``named_parameters``; names carry ``model<i>.`` with several chunks. One
        host synchronization for all of them.
    """
    chunks = _unwrap(model_chunks)
    named = [(f"model{i}.{n}" if len(chunks) > 1 else n, p.detach())
             for i, chunk in enumerate(chunks) for n, p in chunk.named_parameters()]
    named = [(n, t) for n, t in named if t.numel()]
    if not named:
        return []
    peaks = torch.stack([torch.where(torch.isfinite(t).all(), t.abs().amax().float(), torch.inf)
                         for _, t in named]).tolist()
    return [(n, peak) for (n, _), peak in zip(named, peaks, strict=True)
            if peak > ABSURD_MAGNITUDE]


def warn_on_suspicious_parameters(model_chunks, path) -> list[tuple[str, float]]:
    """Warn once per job (rank 0) about loaded parameters that no training produces; collective.

    For a checkpoint loaded with ``checkpoint.verify=false``, where a damaged file is not caught
    by its manifest: the run goes on, the warning names the first such tensor and how many more.

    Returns:
        Every rank's findings (the same list on every rank).
    """
    found = suspicious_parameters(model_chunks)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        every: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, found)
        found = list(dict.fromkeys(item for rank in every for item in rank))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if found and rank == 0:
        name, peak = found[0]
        what = ("a non-finite value" if peak == float("inf")
                else f"a value of magnitude {peak:.3g} (above {ABSURD_MAGNITUDE:g})")
        more = f" (and {len(found) - 1} more parameters like it)" if len(found) > 1 else ""
        logger.warning("checkpoint %s, loaded unverified (checkpoint.verify=false): parameter "
                       "%s holds %s%s; no training produces that, so its file may be damaged "
                       "(verify it, or resume from another checkpoint); the run goes on",
                       path, name, what, more)
    return found


def load_checkpoint(root: str | os.PathLike, model_chunks, optimizer, scheduler,
                    iteration: int | None = None, recipe: dict | None = None,
                    on_saved_recipe: Callable[[dict | None, Path], None] | None = None,
                    ) -> TrainState:
    """Load a finished checkpoint under ``root`` into the model, optimizer and scheduler.

    The model and optimizer reshard to the current parallel layout (dist-checkpointing). The
    RNG states are restored only when the pipeline x tensor layout is the one that saved them;
    otherwise they are left as seeded, with a warning (bitwise continuation needs the same
    layout anyway).

    Args:
        root: the checkpoint directory.
        model_chunks, optimizer, scheduler: what to load into.
        iteration: the checkpoint to load, as chosen (and verified) by
            :func:`find_resume_iteration`; None chooses and verifies it here (no fallback).
        recipe: this run's resolved recipe, compared with the saved one when Megatron fails.
        on_saved_recipe: called with the checkpoint's recipe and path once its common state is
            read, before anything is loaded (the resume's comparison of the two recipes).

    Returns:
        The training state to continue from.

    Raises:
        FileNotFoundError: no finished checkpoint under ``root``.
        CheckpointError: a damaged checkpoint, or Megatron failed to load it (the message names
            the path, Megatron's error and what to do).
        RecipeError: the recipe's schedule differs from the checkpoint's and no scheduler flag
            says which to use (naming the keys, both values and the flags).
    """
    if iteration is None:
        iteration = find_resume_iteration(root)
    if iteration is None:
        raise FileNotFoundError(
            f"checkpoint.load = {str(root)!r}: no finished checkpoint there (expected {POINTER} "
            "naming an iter_NNNNNNN directory)"
        )
    path = checkpoint_name(root, iteration)
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
        saved_layout = list(common["train_state"]["layout"])
    except _LOAD_ERRORS as exc:  # any failure here is reported with the path
        raise _megatron_error(path, exc, None, recipe) from exc
    saved_recipe = common.get("recipe")
    if on_saved_recipe is not None:
        on_saved_recipe(saved_recipe, path)
    pp, tp, _, _ = _layout()
    # Megatron names optimizer param groups by their max/min lr: build the loading state dict
    # with the checkpoint's values, then apply whichever the scheduler flags choose.
    _check_schedule(common.get("scheduler", {}), scheduler, path, recipe)
    chosen_lrs = _reconcile_learning_rates(common.get("scheduler", {}), scheduler)
    _set_group_lrs(optimizer, chosen_lrs, to_saved=True)
    sd = sharded_state_dict(model_chunks, optimizer, scheduler, None, None, is_loading=True)
    same_layout = saved_layout == [pp, tp]
    if not same_layout:
        sd.pop("rng_state")
        logger.warning("checkpoint %s was saved with PP x TP = %s, now %s: RNG state not restored",
                       path, saved_layout, [pp, tp])
    try:
        loaded = dist_checkpointing.load(sd, str(path))
        model_chunks = _unwrap(model_chunks)
        if len(model_chunks) == 1:
            model_chunks[0].load_state_dict(loaded["model"])
        else:
            for i, chunk in enumerate(model_chunks):
                chunk.load_state_dict(loaded[f"model{i}"])
        optimizer.load_state_dict(loaded["optimizer"])
    except _LOAD_ERRORS as exc:  # any failure here is reported with the path
        raise _megatron_error(path, exc, saved_recipe, recipe) from exc
    _set_group_lrs(optimizer, chosen_lrs, to_saved=False)
    scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    ts = loaded["train_state"]
    return TrainState(iteration=int(ts["iteration"]), consumed_samples=int(ts["consumed_samples"]),
                      history=list(ts["history"]))
