"""Checkpoint save/resume with Megatron dist-checkpointing, made atomic.

Layout of ``checkpoint.save``::

    iter_0000020/                  finished checkpoints (dist-checkpointing format)
    latest_checkpointed_iteration.txt   the iteration of the newest finished checkpoint
    iter_0000030.partial/          a save in progress (or one that was interrupted)

A save writes into ``iter_N.partial`` and only after every rank has finished (barrier) does
rank 0 rename it to ``iter_N`` and then replace the pointer file (write a temp file, fsync,
``os.replace``). A crash at any point leaves either the old pointer or a complete new checkpoint;
a stale ``.partial`` directory is never read and is removed by the next save. Resume starts
from the pointer, so it cannot pick up a half-written directory.

Integrity: before the rename, every rank hashes the files it wrote (SHA-256, streamed in
8 MiB reads) and rank 0 writes ``manifest.json`` (size and digest of every file) into the
``.partial`` directory, fsynced. Resume verifies the chosen checkpoint against it (the ranks
split the files between them), so a changed, truncated or deleted file is an error naming the
file and the newest intact other checkpoint instead of a silent resume from damaged tensors;
``checkpoint.fallback=true`` resumes from that one. A missing pointer beside finished
``iter_*`` directories is the same kind of error (never a silent restart that would overwrite
them). Cost: one extra read of the checkpoint at save and at load, about 1 GB/s per rank with
SHA-256 on one core (measured on the CPU machine), divided over the ranks; ADR 0013.

Contents: the model chunks (``model`` or ``model0``, ``model1``, ... with virtual pipelining, as
Megatron-LM names them), the optimizer (sharded from the model's state dict, so it reshards with
the model), the scheduler, the RNG states (one ShardedObject per pipeline x tensor rank) and the
training state (iteration, consumed samples, the loss history for the plot, the recipe).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

logger = logging.getLogger(__name__)

#: What Megatron's loading raises on a bad checkpoint; torch's CheckpointException is a
#: BaseException, which ``except Exception`` would let through.
_LOAD_ERRORS = (Exception, CheckpointException)

POINTER = "latest_checkpointed_iteration.txt"
#: Size and SHA-256 of every other file of a checkpoint directory, written last by the save.
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_READ_BYTES = 8 << 20
_ITER_DIR = re.compile(r"iter_(\d{7})")
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed from; the message names the path and what to do."""


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


def finished_iterations(root: str | os.PathLike) -> list[int]:
    """Iterations of the ``iter_NNNNNNN`` directories under ``root``, ascending.

    ``.partial`` and ``.old`` directories (a save in progress or interrupted) are not listed.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _ITER_DIR.fullmatch(p.name)
        if m and p.is_dir():
            found.append(int(m.group(1)))
    return sorted(found)


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a list of one without a process group)."""
    rank, world = _rank_and_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def _from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if _rank_and_world()[1] == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _owner(name: str, index: int, world: int) -> int:
    """The rank that hashes a file: its writer for ``__R_I.distcp`` files, else round-robin."""
    m = _RANK_FILE.search(name)
    if m and int(m.group(1)) < world:
        return int(m.group(1))
    return index % world


def file_digest(path: str | os.PathLike) -> tuple[int, str]:
    """Size in bytes and SHA-256 hex digest of a file, streamed in 8 MiB reads.

    Cost: one sequential read of the file; SHA-256 runs at about 1 GB/s on one core of the CPU
    machine (hashlib, SHA extensions), so a rank's shard of N GB costs about N seconds.
    """
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_BYTES):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def write_manifest(directory: str | os.PathLike, iteration: int) -> Path:
    """Hash every file of a just-written checkpoint directory and write its manifest; collective.

    Rank 0 lists the directory (after the save's barrier every rank's files are there), each
    rank hashes the files it wrote (the others go round-robin), and rank 0 writes
    ``manifest.json`` with fsync. Call before the directory is renamed to its final name.

    Returns:
        The manifest's path.
    """
    directory = Path(directory)
    rank, world = _rank_and_world()
    names = _from_rank0(sorted(p.name for p in directory.iterdir()
                               if p.is_file() and p.name != MANIFEST) if rank == 0 else None)
    mine = {}
    for i, name in enumerate(names):
        if _owner(name, i, world) == rank:
            size, digest = file_digest(directory / name)
            mine[name] = {"size": size, "sha256": digest}
    files: dict[str, Any] = {}
    for part in _all_gather(mine):
        files.update(part)
    path = directory / MANIFEST
    if rank == 0:
        body = {"format": MANIFEST_FORMAT, "iteration": iteration, "algorithm": "sha256",
                "files": dict(sorted(files.items()))}
        with open(path, "w") as fh:
            json.dump(body, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
    return path


def _read_manifest(directory: Path) -> tuple[dict | None, str | None]:
    path = directory / MANIFEST
    if not directory.is_dir():
        return None, f"{directory} is missing"
    if not path.is_file():
        return None, (f"{path} is missing (every checkpoint this code saves has one; one saved "
                      "without it can be loaded unverified with checkpoint.verify=false)")
    try:
        body = json.loads(path.read_text())
        files = body["files"]
        if body.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {body.get('format')!r}")
        for entry in files.values():
            int(entry["size"]), str(entry["sha256"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        return None, f"{path} is unreadable ({type(err).__name__}: {err})"
    return body, None


def verify_checkpoint(directory: str | os.PathLike) -> list[str]:
    """Check a checkpoint directory against its manifest; collective, same answer on every rank.

    The ranks split the files (as :func:`write_manifest` does) and compare size, then SHA-256.
    Cost: one read of the checkpoint, spread over the ranks (about 1 GB/s per rank).

    Returns:
        One line per problem (``PATH: what is wrong``), empty when the checkpoint is intact.
    """
    directory = Path(directory)
    rank, world = _rank_and_world()
    manifest, problem = _from_rank0(_read_manifest(directory) if rank == 0 else None)
    if problem is not None:
        return [problem]
    mine = []
    for i, (name, entry) in enumerate(sorted(manifest["files"].items())):
        if _owner(name, i, world) != rank:
            continue
        path = directory / name
        if not path.is_file():
            mine.append(f"{path}: missing (the manifest lists it with {entry['size']} bytes)")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            mine.append(f"{path}: {size} bytes, the manifest says {entry['size']} "
                        f"({'truncated' if size < entry['size'] else 'grown'} after the save)")
            continue
        if file_digest(path)[1] != entry["sha256"]:
            mine.append(f"{path}: contents changed after the save (SHA-256 differs from the "
                        "manifest; same size)")
    return sorted(p for part in _all_gather(mine) for p in part)


def _problems(directory: Path, verify: bool) -> list[str]:
    """Problems of a checkpoint directory, empty when intact (collective): the manifest's, or
    without ``verify`` only whether dist-checkpointing's metadata.json exists (rank 0 looks)."""
    if verify:
        return verify_checkpoint(directory)
    problems = None
    if _rank_and_world()[0] == 0:
        problems = ([] if (directory / "metadata.json").is_file()
                    else [f"{directory} is missing or has no metadata.json"])
    return _from_rank0(problems)


def find_resume_iteration(root: str | os.PathLike | None, *, fallback: bool = False,
                          verify: bool = True) -> int | None:
    """Choose the checkpoint to resume from, refusing damaged ones; collective.

    The pointer file names the newest finished checkpoint; it is verified against its manifest
    (``verify``). A missing pointer beside finished ``iter_*`` directories, a pointer that is
    unreadable or names a missing directory, and a damaged checkpoint are errors that name the
    problem and the newest intact other checkpoint. With ``fallback`` the run resumes from that
    one instead (with a warning on stderr).

    Args:
        root: the checkpoint directory (``checkpoint.load`` or ``checkpoint.save``).
        fallback: resume from the newest intact checkpoint when the pointer's one is unusable.
        verify: check files against the manifest (false: only that metadata.json exists).

    Returns:
        The iteration to load, or None when ``root`` holds no checkpoint at all (a fresh start).

    Raises:
        CheckpointError: no usable checkpoint by the pointer and no fallback taken.
    """
    if root is None:
        return None
    root = Path(root)
    pointer = root / POINTER
    # Rank 0 reads the directory and the pointer for everyone, so that every rank takes the
    # same branch (and calls the same collectives) even on a file system whose listings lag.
    listing = None
    if _rank_and_world()[0] == 0:
        listing = (finished_iterations(root),
                   pointer.read_text(errors="replace").strip() if pointer.is_file() else None)
    finished, text = _from_rank0(listing)
    target: int | None = None
    if text is None:
        if not finished:
            return None
        names = ", ".join(checkpoint_name(root, i).name for i in finished)
        problem = (f"{pointer} is missing but {root} holds finished checkpoints ({names}); "
                   "starting from iteration 0 would overwrite them")
    else:
        try:
            target = int(text)
        except ValueError:
            problem = f"checkpoint pointer {pointer} holds {text!r}, not an iteration"
        else:
            bad = _problems(checkpoint_name(root, target), verify)
            if not bad:
                return target
            more = f" (and {len(bad) - 1} more problems)" if len(bad) > 1 else ""
            problem = (f"the newest checkpoint (iteration {target}, named by {pointer}) is "
                       f"damaged or incomplete: {bad[0]}{more}")
    intact = None
    for it in reversed(finished):
        if it != target and not _problems(checkpoint_name(root, it), verify):
            intact = it
            break
    if intact is not None and fallback:
        if _rank_and_world()[0] == 0:
            print(f"warning: {problem}. checkpoint.fallback=true: resuming from "
                  f"{checkpoint_name(root, intact)}", file=sys.stderr, flush=True)
        return intact
    if intact is not None:
        advice = (f"The newest intact checkpoint is {checkpoint_name(root, intact)}: pass "
                  "checkpoint.fallback=true to resume from it")
    else:
        advice = f"No other intact checkpoint is in {root}"
    moved = "the iter_* directories" if text is None else "the damaged directories"
    advice += f", or move {moved} away (or set another checkpoint.save) to start from scratch"
    if target is None and intact is not None:
        advice += f", or restore {pointer} (it holds the iteration number)"
    raise CheckpointError(f"cannot resume: {problem}. {advice}.")


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
    write_manifest(partial, state.iteration)
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


def _recipe_differences(saved: dict, current: dict | None) -> list[str]:
    """The ``model.*`` keys whose values differ between the saved recipe and this run's."""
    if not isinstance(saved, dict) or not current:
        return []
    a, b = saved.get("model") or {}, current.get("model") or {}
    return [f"model.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


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
    diff = _recipe_differences(saved_recipe or {}, recipe)
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


def load_checkpoint(root: str | os.PathLike, model_chunks, optimizer, scheduler,
                    iteration: int | None = None, recipe: dict | None = None) -> TrainState:
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

    Returns:
        The training state to continue from.

    Raises:
        FileNotFoundError: no finished checkpoint under ``root``.
        CheckpointError: a damaged checkpoint, or Megatron failed to load it (the message names
            the path, Megatron's error and what to do).
        ValueError: the recipe's schedule differs from the checkpoint's and no scheduler flag
            says which to use.
    """
    from megatron.core import dist_checkpointing

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
