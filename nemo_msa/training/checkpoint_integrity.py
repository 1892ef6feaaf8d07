"""A checkpoint root on disk: which checkpoints are finished, whether they are intact, which to
resume from.

Layout of ``checkpoint.save``::

    iter_0000020/                  finished checkpoints (dist-checkpointing format)
    latest_checkpointed_iteration.txt   the iteration of the newest finished checkpoint
    iter_0000030.partial/          a save in progress (or one that was interrupted)

Only ``iter_NNNNNNN`` directories count as finished; resume starts from the pointer file, so it
cannot pick up a half-written directory (the atomic save is in :mod:`nemo_msa.training.checkpoint`).

Integrity: before the rename, every rank hashes the files it wrote (SHA-256, streamed in
8 MiB reads) and rank 0 writes ``manifest.json`` (size and digest of every file) into the
``.partial`` directory, fsynced (:func:`write_manifest`). Resume verifies the chosen checkpoint
against it (the ranks split the files between them), so a changed, truncated or deleted file is
an error naming the file and the newest intact other checkpoint instead of a silent resume from
damaged tensors; ``checkpoint.fallback=true`` resumes from that one. A missing pointer beside
finished ``iter_*`` directories is the same kind of error (never a silent restart that would
overwrite them). Cost: one extra read of the checkpoint at save and at load, about 1 GB/s per
rank with SHA-256 on one core (measured on the CPU machine), divided over the ranks; ADR 0013.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

POINTER = "latest_checkpointed_iteration.txt"
#: Size and SHA-256 of every other file of a checkpoint directory, written last by the save.
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_READ_BYTES = 8 << 20
_ITER_DIR = re.compile(r"iter_(\d{7})")
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed from; the message names the path and what to do."""



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


def finished_iterations_everywhere(root: str | os.PathLike) -> list[int]:
    """:func:`finished_iterations` as rank 0 lists them, on every rank (collective), so that
    every rank takes the same branch on a file system whose listings lag."""
    return _from_rank0(finished_iterations(root) if _rank_and_world()[0] == 0 else None)


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


__all__ = ["MANIFEST", "POINTER", "CheckpointError", "checkpoint_name", "file_digest",
           "find_resume_iteration", "finished_iterations", "latest_iteration",
           "verify_checkpoint", "write_manifest"]
