"""One memo for values derived from a tensor: keyed on the tensor's identity and ``_version``.

The per-microbatch layouts (nemo_msa.layout, nemo_msa.context_parallel), a query subset's kernel
view (nemo_msa.triton.kernel_layout) and the full rotary table under context parallelism
(nemo_msa.megatron.microbatch) are each derived once from a tensor every layer receives and
shared until that tensor is freed or written in place.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

__all__ = ["TensorMemo"]


class TensorMemo:
    """Weak-identity memo: (tensor, key) -> value, valid while the tensor's ``_version`` holds.

    Tensors hash by identity but compare elementwise, so a WeakKeyDictionary cannot hold them;
    this keys a plain dict on ``id(tensor)`` and drops the entry from a weakref finalizer, so a
    value lives exactly as long as the tensor it was derived from. An in-place write through the
    tensor bumps ``_version`` and the next :meth:`get` misses (writes through ``.data`` or
    ``.numpy()`` do not, see nemo_msa.layout).
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, dict[Any, tuple[int, Any]]]] = {}
        self._lock = threading.Lock()

    def get(self, tensor: torch.Tensor, key: Any = None) -> Any | None:
        """The value stored for ``tensor`` and ``key`` at the tensor's current version, or None."""
        with self._lock:
            entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        stored = entry[1].get(key)
        if stored is None or stored[0] != tensor._version:
            return None
        return stored[1]

    def put(self, tensor: torch.Tensor, key: Any, value: Any) -> None:
        """Stores ``value`` for ``tensor`` (at its current version) and ``key``."""
        tensor_id = id(tensor)
        with self._lock:
            entry = self._entries.get(tensor_id)
            if entry is None or entry[0]() is not tensor:
                entry = (weakref.ref(tensor), {})
                self._entries[tensor_id] = entry
                weakref.finalize(tensor, self._drop, tensor_id, entry[0])
            entry[1][key] = (tensor._version, value)

    def _drop(self, tensor_id: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._entries.get(tensor_id)
            if entry is not None and entry[0] is ref:
                del self._entries[tensor_id]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
