"""Selection replay under full activation recompute (docs/adr/0028-selection-replay.md).

With ``recompute_granularity="full"`` Megatron runs each checkpointed chunk of layers twice: a
first forward under ``torch.no_grad()`` inside ``CheckpointFunction.forward``, and a recompute
with grad enabled inside its backward (RNG states restored). An MSA layer records in the first
forward what the recompute would otherwise compute again, and the recompute takes it back:

- the microbatch layout (its build needs a host sync, and under context parallelism a
  collective);
- the block selection of a sparse layer (the indexer's quadratic scoring and the top-k).

The recompute then attends exactly the blocks the first forward attended (no second scoring
pass), so its output is the first forward's, bit for bit.

Each MSA attention module holds one :class:`SelectionReplay`: entries are per layer by
construction (a virtual-pipeline chunk has its own modules). Within a layer an entry is keyed on
the microbatch's document map (``attention_mask``, or ``packed_seq_params.cu_seqlens_q`` for THD
input), which Megatron's checkpoint saves and hands back to the recompute as a detached alias
(same storage, same version counter). The entry holds only a weak reference to the tensor it was
recorded for, so it dies with its microbatch. Microbatches that share one document-map tensor
(or have none) are matched in first-forward order, which is the order every Megatron schedule
(no pipelining, 1F1B, interleaved) runs a chunk's backwards in.

Lifetime: an entry is taken (removed) by the recompute of its layer, so after a step's backward
the stores are empty. Entries that no recompute will take (a forward that raised, a forward
without backward) are dropped when their document map is freed, at the next
:func:`nemo_msa.megatron.set_training_iteration` (the project's loop calls it before every step),
or by :func:`clear_selection_replay`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.tensor_parallel.random import is_checkpointing

from nemo_msa.megatron.phase import get_training_step_count

__all__ = [
    "RECORD",
    "REPLAY",
    "ReplayEntry",
    "SelectionReplay",
    "clear_selection_replay",
    "document_map_anchor",
    "recompute_phase",
]

#: The first forward of a fully recomputed chunk (no grad): the layer records.
RECORD = "record"
#: The recompute in the chunk's backward (grad enabled): the layer takes back what it recorded.
REPLAY = "replay"


def recompute_phase(config: Any, training: bool) -> str | None:
    """Which pass of a fully recomputed chunk is running, from inside one of its layers.

    Megatron's ``CheckpointFunction`` flags both of its passes (``is_checkpointing()``); its
    first forward runs without grad, the recompute with grad. Selective recompute (core_attn)
    keeps the selection in the layer itself and needs no store.

    Args:
        config: the layer's TransformerConfig (``recompute_granularity``).
        training: the module's training flag (Megatron recomputes only in training).

    Returns:
        ``"record"`` (first forward), ``"replay"`` (recompute) or None (no full recompute here:
        not training, another granularity, or a layer outside the recomputed ones of the
        ``"block"`` method).
    """
    if not training or getattr(config, "recompute_granularity", None) != "full":
        return None
    if not is_checkpointing():
        return None
    return REPLAY if torch.is_grad_enabled() else RECORD


def document_map_anchor(attention_mask: torch.Tensor | None, packed_seq_params) -> Any:
    """The tensor that identifies a microbatch to its layers: the document map, or None.

    Args:
        attention_mask: what the layer received (document ids or a block-causal mask), or None.
        packed_seq_params: THD ``PackedSeqParams`` (the closure of Megatron's checkpoint hands
            the same object to the recompute), or None.

    Returns:
        ``attention_mask``, else ``packed_seq_params.cu_seqlens_q``, else None.
    """
    if attention_mask is not None:
        return attention_mask
    if packed_seq_params is not None:
        return getattr(packed_seq_params, "cu_seqlens_q", None)
    return None


def _signature(tensor: torch.Tensor | None) -> tuple | None:
    """What a detached alias shares with its original: storage address, view, version."""
    if tensor is None:
        return None
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
        tensor._version,
    )


@dataclass(frozen=True)
class ReplayEntry:
    """What one layer recorded for one microbatch in the first forward.

    Attributes:
        layout: the microbatch's :class:`nemo_msa.context_parallel.ContextParallelLayout`.
        selection: a sparse layer's :class:`nemo_msa.q2k.Selection` (``nemo_msa.ops.select``:
            q2k int32 [Hkv_local, Tq, top_k]); None for a dense layer or the dense warm-up.
        seq_len: the activations' sequence length the layout was built for (checked on take).
        batch_size: the activations' batch size (checked on take).
    """

    layout: Any
    selection: Any
    seq_len: int
    batch_size: int


@dataclass
class _Slot:
    anchor: weakref.ref | None
    signature: tuple | None
    step: int
    entry: ReplayEntry

    def alive(self) -> bool:
        return self.anchor is None or self.anchor() is not None


class SelectionReplay:
    """One layer's store of first-forward selections, taken back by the recompute."""

    def __init__(self) -> None:
        self._slots: list[_Slot] = []
        #: How many entries were recorded and taken since construction (for tests and logs).
        self.num_recorded = 0
        self.num_taken = 0

    def _prune(self) -> None:
        """Drops entries of freed microbatches and of earlier training steps."""
        step = get_training_step_count()
        self._slots = [slot for slot in self._slots if slot.alive() and slot.step == step]

    def record(self, anchor: torch.Tensor | None, entry: ReplayEntry) -> None:
        """Stores what the first forward of one microbatch computed.

        Args:
            anchor: :func:`document_map_anchor` of the microbatch.
            entry: the layout and selection.
        """
        self._prune()
        self._slots.append(
            _Slot(
                anchor=None if anchor is None else weakref.ref(anchor),
                signature=_signature(anchor),
                step=get_training_step_count(),
                entry=entry,
            )
        )
        self.num_recorded += 1

    def take(self, anchor: torch.Tensor | None, seq_len: int, batch_size: int) -> ReplayEntry:
        """Removes and returns the oldest entry recorded for this microbatch.

        Args:
            anchor: :func:`document_map_anchor` of the microbatch in the recompute (a detached
                alias of the first forward's tensor).
            seq_len: the activations' sequence length.
            batch_size: the activations' batch size.

        Returns:
            The entry of the first forward.

        Raises:
            RuntimeError: no entry for this microbatch (the first forward did not run this
                layer under the same recompute setting), or one built for other activations.
        """
        self._prune()
        signature = _signature(anchor)
        for index, slot in enumerate(self._slots):
            if slot.signature == signature:
                entry = self._slots.pop(index).entry
                if (entry.seq_len, entry.batch_size) != (seq_len, batch_size):
                    raise RuntimeError(
                        f"selection replay: the first forward recorded activations of "
                        f"[s={entry.seq_len}, b={entry.batch_size}] for this document map but "
                        f"the recompute runs [s={seq_len}, b={batch_size}]"
                    )
                self.num_taken += 1
                return entry
        raise RuntimeError(
            "selection replay: the recompute of an MSA layer found no selection recorded by its "
            f"first forward ({len(self._slots)} pending for other microbatches); the training "
            "mode, recompute_granularity or the training iteration changed between the forward "
            "and the backward"
        )

    def clear(self) -> None:
        """Drops every entry."""
        self._slots = []

    def __len__(self) -> int:
        """Entries pending (recorded, not yet taken, not yet known to be stale)."""
        self._prune()
        return len(self._slots)


def clear_selection_replay(model: torch.nn.Module | Iterable[torch.nn.Module]) -> int:
    """Drops the pending entries of every MSA layer of a model (or of a list of chunks).

    A loop that does not call :func:`nemo_msa.megatron.set_training_iteration` and reuses one
    document-map tensor (or passes none) across steps calls this after a step that raised.

    Returns:
        How many entries were dropped.
    """
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    dropped = 0
    for chunk in chunks:
        for module in chunk.modules():
            store = getattr(module, "selection_replay", None)
            if isinstance(store, SelectionReplay):
                dropped += len(store._slots)
                store.clear()
    return dropped
