"""Checkpoint save/resume with Megatron dist-checkpointing, made atomic.

Layout of ``checkpoint.save``::

    iter_0000020/                  finished checkpoints (dist-checkpointing format)
    latest_checkpointed_iteration.txt   the iteration of the newest finished checkpoint
    iter_0000030.partial/          a save in progress (or one that was interrupted)

A save writes into ``iter_N.partial`` and only after every rank has finished (barrier) does
rank 0 rename it to ``iter_N`` and then replace the pointer file (write a temp file, fsync,
``os.replace``). A crash at any point leaves either the old pointer or a complete new checkpoint;
a stale ``.partial`` directory is never read and is removed by the next save. Resume reads only
the pointer, so it cannot pick up a half-written directory.

Contents: the model chunks (``model`` or ``model0``, ``model1``, ... with virtual pipelining, as
Megatron-LM names them), the optimizer (sharded from the model's state dict, so it reshards with
the model), the scheduler, the RNG states (one ShardedObject per pipeline x tensor rank) and the
training state (iteration, consumed samples, the loss history for the plot, the recipe).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

POINTER = "latest_checkpointed_iteration.txt"


@dataclass
class TrainState:
    """What the loop needs to continue exactly where it stopped."""

    iteration: int = 0
    consumed_samples: int = 0
    #: One dict of metrics per finished step (loss, indexer loss, recall, lr, ...).
    history: list[dict[str, float]] = field(default_factory=list)


def checkpoint_name(root: str | os.PathLike, iteration: int) -> Path:
    """The directory of the finished checkpoint of ``iteration``."""
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | os.PathLike | None) -> int | None:
    """The iteration named by the pointer file, or None when there is no finished checkpoint.

    Raises:
        RuntimeError: the pointer names a directory that does not exist or lacks
            dist-checkpointing's metadata (the checkpoint root was tampered with).
    """
    if root is None:
        return None
    pointer = Path(root) / POINTER
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    try:
        iteration = int(text)
    except ValueError as err:
        raise RuntimeError(
            f"checkpoint pointer {pointer} holds {text!r}, not an iteration"
        ) from err
    ckpt = checkpoint_name(root, iteration)
    if not (ckpt / "metadata.json").is_file():
        raise RuntimeError(
            f"checkpoint pointer {pointer} names iteration {iteration}, but {ckpt} is missing or "
            "has no metadata.json (expected a finished dist-checkpointing directory)"
        )
    return iteration


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

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
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _layout() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())


def _unwrap(model_chunks) -> list:
    """The GPT modules inside DDP / Float16Module, whose keys match Megatron-LM checkpoints."""
    from megatron.core.utils import unwrap_model

    return [unwrap_model(m) for m in model_chunks]


def sharded_state_dict(model_chunks, optimizer, scheduler, state: TrainState | None,
                       recipe: dict | None, is_loading: bool) -> dict[str, Any]:
    """Build the dist-checkpointing state dict of the whole training state on this rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

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
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not getattr(filesystem_async, "HAVE_PSUTIL", True):
        filesystem_async._process_memory = _rss_bytes


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
    """
    from megatron.core import dist_checkpointing

    _ensure_memory_probe()
    root = Path(root)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    final = checkpoint_name(root, state.iteration)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        # Leftovers of an interrupted save of this iteration are never trusted.
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
    _barrier()
    sd = sharded_state_dict(model_chunks, optimizer, scheduler, state, recipe, is_loading=False)
    dist_checkpointing.save(sd, str(partial))
    _barrier()
    if rank == 0:
        if final.exists():
            # Re-saving an iteration (e.g. after a resume): drop the older copy only now that the
            # new one is complete; the pointer still names it until os.replace below.
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        _write_pointer(root, state.iteration)
        if keep_last:
            finished = sorted(p for p in root.glob("iter_???????") if p.is_dir())
            for old in finished[:-keep_last]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _reconcile_learning_rates(saved: dict, scheduler, path) -> dict[str, tuple[float, ...]]:
    """Compare the checkpoint's max/min lr with the recipe's and decide which to train with.

    Returns:
        ``{"max_lr": (recipe, saved, chosen), "min_lr": (recipe, saved, chosen)}``.

    Raises:
        ValueError: a value changed and neither scheduler flag says which one to use.
    """
    result = {}
    for name, key in (("max_lr", "optimizer.lr"), ("min_lr", "optimizer.min_lr")):
        now = float(getattr(scheduler, name))
        was = float(saved.get("start_lr" if name == "max_lr" and "start_lr" in saved else name,
                              now))
        if was != now and not (scheduler.override_opt_param_scheduler
                               or scheduler.use_checkpoint_opt_param_scheduler):
            raise ValueError(
                f"recipe key '{key}' = {now} but checkpoint {path} was trained with {was}: pass "
                "scheduler.override_opt_param_scheduler=true to train on with the recipe's "
                "value, or scheduler.use_checkpoint_opt_param_scheduler=true to keep the "
                "checkpoint's"
            )
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


def load_checkpoint(root: str | os.PathLike, model_chunks, optimizer, scheduler) -> TrainState:
    """Load the newest finished checkpoint under ``root`` into the model, optimizer, scheduler.

    The model and optimizer reshard to the current parallel layout (dist-checkpointing). The
    RNG states are restored only when the pipeline x tensor layout is the one that saved them;
    otherwise they are left as seeded, with a warning (bitwise continuation needs the same
    layout anyway).

    Returns:
        The training state to continue from.

    Raises:
        FileNotFoundError: no finished checkpoint under ``root``.
    """
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(
            f"checkpoint.load = {str(root)!r}: no finished checkpoint there (expected {POINTER} "
            "naming an iter_NNNNNNN directory)"
        )
    path = checkpoint_name(root, iteration)
    common = dist_checkpointing.load_common_state_dict(str(path))
    saved_layout = list(common["train_state"]["layout"])
    pp, tp, _, _ = _layout()
    # Megatron names optimizer param groups by their max/min lr: build the loading state dict
    # with the checkpoint's values, then apply whichever the scheduler flags choose.
    chosen_lrs = _reconcile_learning_rates(common.get("scheduler", {}), scheduler, path)
    _set_group_lrs(optimizer, chosen_lrs, to_saved=True)
    sd = sharded_state_dict(model_chunks, optimizer, scheduler, None, None, is_loading=True)
    same_layout = saved_layout == [pp, tp]
    if not same_layout:
        sd.pop("rng_state")
        logger.warning("checkpoint %s was saved with PP x TP = %s, now %s: RNG state not restored",
                       path, saved_layout, [pp, tp])
    loaded = dist_checkpointing.load(sd, str(path))
    model_chunks = _unwrap(model_chunks)
    if len(model_chunks) == 1:
        model_chunks[0].load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(model_chunks):
            chunk.load_state_dict(loaded[f"model{i}"])
    optimizer.load_state_dict(loaded["optimizer"])
    _set_group_lrs(optimizer, chosen_lrs, to_saved=False)
    try:
        scheduler.load_state_dict(loaded["scheduler"])
    except AssertionError as exc:  # Megatron asserts equal schedules unless a flag says otherwise
        raise ValueError(
            f"checkpoint {path} was trained with another schedule than the recipe's ({exc}): "
            "pass scheduler.override_opt_param_scheduler=true to continue with the recipe's "
            "(e.g. after raising train.train_iters), or "
            "scheduler.use_checkpoint_opt_param_scheduler=true to keep the checkpoint's"
        ) from exc
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    ts = loaded["train_state"]
    return TrainState(iteration=int(ts["iteration"]), consumed_samples=int(ts["consumed_samples"]),
                      history=list(ts["history"]))
