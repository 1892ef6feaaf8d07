"""Digests of what a checkpoint holds, independent of where it was saved and by how many ranks.

The file digests of a checkpoint's manifest (ADR 0013) prove its files are the ones written. Two
runs that computed the same state still write different files: the common state holds the
recipe (with the run's ``checkpoint.save`` path), torch's ``.metadata`` a random id per save,
and another data-parallel size other shard files. :func:`content_digests` hashes every item
instead (SHA-256): each tensor as a whole (dtype, shape and bytes; model and optimizer), each
stored object by its value (the RNG states, the modules' extra state), and the common state
(iteration, consumed samples, loss history, scheduler, optimizer groups) without its recipe.
Two checkpoints with equal digests resume into the same training state bit for bit; that is how
the determinism checks compare runs (ADR 0050).

Run ``python -m nemo_msa.training.checkpoint_digests DIR [DIR2]`` for a checkpoint's digests,
or for the items in which two differ. It reads the whole checkpoint into host memory: a tool
for the small models of tests and checks, not for a 426B-parameter checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

#: The item holding Megatron's common state (a ShardedObject of dist-checkpointing).
COMMON_PREFIX = "common_state/"
#: Entries of the common state left out of the digest: the recipe holds the run's paths.
UNHASHED_COMMON = ("recipe",)


def _feed(h, obj: Any) -> None:
    """Feed a canonical serialization of ``obj`` (nested dicts, sequences, tensors, arrays,
    numbers) into the hash ``h``: equal values give equal bytes, floats to the bit."""
    if isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode() + b":")
            _feed(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[" if isinstance(obj, list) else b"(")
        for item in obj:
            _feed(h, item)
        h.update(b"]")
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(f"array {obj.dtype} {obj.shape}:".encode() + np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, float):
        h.update(b"float " + obj.hex().encode())
    else:
        h.update(f"{type(obj).__name__} {obj!r}".encode())
    h.update(b";")


def _digest(obj: Any) -> str:
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def content_digests(path: str | os.PathLike) -> dict[str, str]:
    """SHA-256 of every item of the checkpoint at ``path`` (an ``iter_NNNNNNN`` directory).

    Reads the checkpoint with torch's distributed-checkpoint reader in this process alone (no
    process group needed).

    Returns:
        ``{item: hex digest}``: tensors by their global name, stored objects by their key
        (``rng_state/shard_...``, ``..._extra_state/shard_...``), the common state under its
        key, hashed without :data:`UNHASHED_COMMON`.
    """
    reader = FileSystemReader(str(path))
    state: dict[str, Any] = {}
    for key, item in reader.read_metadata().state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            state[key] = io.BytesIO()
    with warnings.catch_warnings():
        # "torch.distributed is disabled ...: assuming ... a single process": as asked.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    digests = {}
    for key, value in state.items():
        if isinstance(value, io.BytesIO):  # torch hands some objects back unread
            value.seek(0)
            value = torch.load(value, map_location="cpu", weights_only=True)
        if key.startswith(COMMON_PREFIX):
            # Stored as a one-item list holding the common state dict (dist-checkpointing).
            value = [{k: v for k, v in item.items() if k not in UNHASHED_COMMON}
                     if isinstance(item, dict) else item for item in value]
        digests[key] = _digest(value)
    return digests


def differing_items(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The items whose digests differ, or that only one of two checkpoints holds (sorted)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def main(argv: list[str] | None = None) -> int:
    """Print one checkpoint's content digests (JSON), or compare two; exit 1 when they differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", metavar="DIR",
                        help="one iter_NNNNNNN directory, or two to compare")
    args = parser.parse_args(argv)
    if len(args.checkpoints) > 2:
        parser.error(f"expected one or two checkpoints, got {len(args.checkpoints)}")
    digests = [content_digests(Path(p)) for p in args.checkpoints]
    if len(digests) == 1:
        print(json.dumps(digests[0], indent=1, sort_keys=True))
        return 0
    differ = differing_items(*digests)
    for key in differ:
        print(f"differs: {key}")
    print(f"{len(digests[0])} items; {len(differ)} differ", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["COMMON_PREFIX", "UNHASHED_COMMON", "content_digests", "differing_items", "main"]
