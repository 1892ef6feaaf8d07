"""One MSAMicrobatch per microbatch per rank: the layer-side lookup and the data-side cache.

How the document map reaches every layer (docs/adr/0005-document-map-to-layers.md): the loader's
``packed_seq_ids`` [b, s] (int, 0 = padding) is passed to ``GPTModel.forward`` as
``attention_mask``; Megatron hands ``attention_mask`` unchanged to every TransformerLayer and its
self-attention, where :func:`layout_for_layer` turns it into the shared layout.
:meth:`nemo_msa.MSAMicrobatch.build` memoizes on the tensor's identity and ``_version``, so all
layers of a chunk that receive the same tensor object share one layout (one host sync).

With the interleaved (virtual-pipeline) schedule every model chunk calls the user's
``forward_step_func`` with its own data iterator, and a per-chunk ``get_batch`` would produce a
different tensor object per chunk (and a new layout each time). :class:`SharedMicrobatchIterators`
fixes that on the data side: it reads each microbatch once from the real iterator, moves its
tensors to the device once, and hands the *same* objects to every chunk's iterator::

    shared = SharedMicrobatchIterators(train_iterator, num_chunks=len(model), device=device)
    forward_backward_func(..., data_iterator=shared.iterators(), model=model, ...)

    def forward_step(data_iterator, model_chunk):
        batch = next(data_iterator)            # same dict object for every chunk
        output = model_chunk(batch["tokens"], batch["position_ids"],
                             attention_mask=batch["packed_seq_ids"], labels=batch["labels"])
        ...

Every pipeline stage (not only the first and last) must receive ``packed_seq_ids``, because its
MSA layers need the document map.

Context parallelism and THD input (:func:`context_parallel_layout_for_layer`): under CP the
layer's activations hold the rank's load-balanced chunks; its ``attention_mask`` is either the
global ids [b, S] or the rank's [b, S / N] (gathered once per microbatch), and the layer works
through a :class:`nemo_msa.context_parallel.ContextParallelLayout` (memoized on that tensor).
THD input (``packed_seq_params``, qkv_format "thd") is one row of packed sequences whose document
map comes from ``cu_seqlens_q`` (and ``cu_seqlens_q_padded``), with or without CP.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from nemo_msa.context_parallel import (
    ContextParallelLayout,
    gather_from_context_parallel,
    load_balanced_indices,
)
from nemo_msa.layout import MSAMicrobatch
from nemo_msa.support import MSATopology
from nemo_msa.tensor_memo import TensorMemo

__all__ = [
    "SharedMicrobatchIterators",
    "context_parallel_layout_for_layer",
    "full_rotary_table",
    "layout_for_layer",
    "move_to_device",
    "pack_sbhd",
    "unpack_sbhd",
]


def move_to_device(batch: Any, device: torch.device | str | None) -> Any:
    """Moves every tensor of a (nested dict/list/tuple) batch to ``device``; None = unchanged.

    ``Tensor.to`` returns the tensor itself when it is already there, so a batch already on the
    device keeps its tensor identities (and the layouts memoized on them).
    """
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(value, device) for value in batch]
        return type(batch)(moved) if isinstance(batch, list) else tuple(moved)
    return batch


class SharedMicrobatchIterators:
    """Per-chunk iterators that return the same microbatch objects to every model chunk.

    Args:
        data_iterator: yields one microbatch per ``next`` (a dict/tuple of tensors).
        num_chunks: model chunks on this rank (the virtual pipeline size; 1 without VPP).
        device: where to move the tensors once (None: leave them).

    The k-th ``next`` of every chunk's iterator returns the k-th microbatch; a microbatch is
    released once every chunk has taken it, so the buffer holds only the microbatches in flight.
    """

    def __init__(
        self, data_iterator: Iterator, num_chunks: int, device: torch.device | str | None = None
    ) -> None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"num_chunks={num_chunks!r}; expected an int >= 1")
        self._source = data_iterator
        self._device = device
        self._num_chunks = num_chunks
        self._buffer: deque[Any] = deque()
        self._first = 0  # index of the microbatch at the head of the buffer
        self._positions = [0] * num_chunks
        self.num_fetched = 0

    def _take(self, chunk: int) -> Any:
        position = self._positions[chunk]
        while position >= self._first + len(self._buffer):
            batch = next(self._source)  # StopIteration propagates to the caller
            self._buffer.append(move_to_device(batch, self._device))
            self.num_fetched += 1
        batch = self._buffer[position - self._first]
        self._positions[chunk] = position + 1
        while self._buffer and min(self._positions) > self._first:
            self._buffer.popleft()
            self._first += 1
        return batch

    def iterator(self, chunk: int) -> Iterator:
        """The iterator of model chunk ``chunk``."""
        if not 0 <= chunk < self._num_chunks:
            raise ValueError(f"chunk={chunk}; expected 0..{self._num_chunks - 1}")
        while True:
            try:
                yield self._take(chunk)
            except StopIteration:
                return

    def iterators(self) -> list[Iterator]:
        """One iterator per chunk, in chunk order (Megatron's ``data_iterator`` list)."""
        return [self.iterator(chunk) for chunk in range(self._num_chunks)]


def _check_mask_device(attention_mask: torch.Tensor | None, device: torch.device) -> None:
    """The document map must already be on the activations' device: moving it here would create
    a new tensor per layer and defeat the per-microbatch layout."""
    if attention_mask is not None and attention_mask.device != torch.device(device):
        raise ValueError(
            f"attention_mask (the document map) is on {attention_mask.device} but the "
            f"activations are on {device}; move the batch to the device once per microbatch "
            "(nemo_msa.megatron.SharedMicrobatchIterators does)"
        )


def _layout_fields(topology: MSATopology) -> dict:
    """The layout's block size and forced blocks, from the plan's checked topology."""
    return dict(block_size=topology.block_size, init_blocks=topology.init_blocks,
                local_blocks=topology.local_blocks)


def layout_for_layer(
    attention_mask: torch.Tensor | None, batch_size: int, seq_len: int, device: torch.device,
    topology: MSATopology,
) -> Any:
    """The microbatch layout an MSA layer uses, from the ``attention_mask`` it receives.

    Args:
        attention_mask: None (one document per row); int [b, s] document ids (the loader's
            packed_seq_ids; 0 = padding); or bool [b, 1, s, s] block-causal (True = keep).
        batch_size: b of the activations.
        seq_len: full sequence length s of the activations (before sequence-parallel split).
        device: the activations' device.
        topology: the layer's plan's topology (``msa_plan.topology``: the block size and forced
            blocks, checked when the layer was built).

    Returns:
        The shared :class:`nemo_msa.MSAMicrobatch` (memoized on the mask tensor).

    Raises:
        ValueError: the mask lives on another device than the activations (moving it here would
            create a new tensor per layer and defeat the per-microbatch layout), or its shape
            disagrees with the activations.
    """
    _check_mask_device(attention_mask, device)
    if attention_mask is not None:
        if attention_mask.dim() == 2 and tuple(attention_mask.shape) != (batch_size, seq_len):
            raise ValueError(
                f"attention_mask (document ids) has shape {tuple(attention_mask.shape)}; "
                f"expected [batch={batch_size}, sequence={seq_len}]"
            )
    try:
        return MSAMicrobatch.build(
            attention_mask=attention_mask,
            batch_size=batch_size,
            seq_len=seq_len,
            device=device,
            **_layout_fields(topology),
        )
    except ValueError as error:
        if attention_mask is not None and attention_mask.dim() == 4:
            # The common mistake: Megatron's GPT datasets build 4-D masks with True = masked out.
            raise ValueError(
                f"{error}. Note: MSA reads a 4-D attention_mask as True = keep (block-causal), "
                "while Megatron's GPT datasets build True = masked out; pass the loader's "
                "packed_seq_ids [b, s] as attention_mask instead"
            ) from error
        raise


def _sbhd_rows(msa) -> torch.Tensor:
    """int64 [T]: row of each compact token in a [s * b] flattening (Megatron's [s, b] order)."""

    def make() -> torch.Tensor:
        rows = msa.token_rows  # flat index row * s + column into [b * s]
        return (rows % msa.seq_len) * msa.batch_size + rows // msa.seq_len

    return msa.cached("nemo_msa.megatron.sbhd_rows", make)


def pack_sbhd(msa, x: torch.Tensor) -> torch.Tensor:
    """Gathers the real tokens of a Megatron [s, b, ...] tensor: -> compact [T, ...].

    Same result as ``msa.pack(x.transpose(0, 1))`` with one gather instead of a transposing copy
    followed by a gather.
    """
    if x.dim() < 2 or x.shape[0] != msa.seq_len or x.shape[1] != msa.batch_size:
        raise ValueError(
            f"x must be [sequence={msa.seq_len}, batch={msa.batch_size}, ...]; got shape "
            f"{tuple(x.shape)}"
        )
    return x.reshape(msa.seq_len * msa.batch_size, *x.shape[2:])[_sbhd_rows(msa)]


def unpack_sbhd(msa, x: torch.Tensor) -> torch.Tensor:
    """Scatters compact tokens [T, ...] into a Megatron [s, b, ...] tensor, zeros at padding."""
    if x.dim() < 1 or x.shape[0] != msa.num_tokens:
        raise ValueError(f"x must be [tokens={msa.num_tokens}, ...]; got shape {tuple(x.shape)}")
    out = x.new_zeros(msa.seq_len * msa.batch_size, *x.shape[1:])
    out = out.index_copy(0, _sbhd_rows(msa), x)
    return out.view(msa.seq_len, msa.batch_size, *x.shape[1:])


def _single_rank_view(msa: MSAMicrobatch) -> ContextParallelLayout:
    """The N = 1 view of a layout (queries None, the layout's own [s, b] maps), shared."""

    def make() -> ContextParallelLayout:
        columns = load_balanced_indices(msa.seq_len, 1, 0, device=msa.device)
        return ContextParallelLayout.from_global(msa, columns, columns, 1, 0)

    return msa.cached("nemo_msa.megatron.single_rank_view", make)


def _thd_layout(packed_seq_params, attention_mask, batch_size, seq_len, device, topology, group):
    if attention_mask is not None:
        raise ValueError(
            "attention_mask and packed_seq_params were both given; THD input takes its document "
            "map from packed_seq_params.cu_seqlens_q, pass attention_mask=None"
        )
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt != "thd":
        raise NotImplementedError(
            f"packed_seq_params.qkv_format={fmt!r}: MSA attention takes THD packed sequences "
            "(qkv_format 'thd') or BSHD input with packed_seq_ids as attention_mask"
        )
    cu = packed_seq_params.cu_seqlens_q
    cu_kv = getattr(packed_seq_params, "cu_seqlens_kv", None)
    if cu is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None; THD input needs it")
    if cu_kv is not None and cu_kv is not cu and not torch.equal(cu_kv, cu):
        raise NotImplementedError(
            "packed_seq_params.cu_seqlens_kv differs from cu_seqlens_q: MSA attention is "
            "self-attention (one pack of sequences for queries and keys)"
        )
    if batch_size != 1:
        raise ValueError(
            f"THD activations must be [tokens, 1, hidden]; got batch {batch_size} with "
            "packed_seq_params"
        )
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    layout = ContextParallelLayout.build_thd(
        cu, padded, group=group, device=device, **_layout_fields(topology),
    )
    if layout.seq_len_local != seq_len:
        raise ValueError(
            f"packed_seq_params describe {layout.msa.seq_len} tokens ({layout.seq_len_local} on "
            f"this context-parallel rank) but the activations hold {seq_len}"
        )
    return layout


def context_parallel_layout_for_layer(
    attention_mask: torch.Tensor | None,
    packed_seq_params,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    topology: MSATopology,
    cp_group,
) -> ContextParallelLayout:
    """The layout an MSA layer uses, with or without context parallelism and THD input.

    Args:
        attention_mask: as :func:`layout_for_layer` (the global ids or, under CP, this rank's
            [b, S / N] ids), or None.
        packed_seq_params: Megatron's ``PackedSeqParams`` for THD input (qkv_format "thd",
            ``cu_seqlens_q``, optional ``cu_seqlens_q_padded``), or None for BSHD.
        batch_size: b of the activations.
        seq_len: this rank's sequence length of the activations (before the sequence-parallel
            split, after the context-parallel one).
        device: the activations' device.
        topology: the layer's plan's topology (:func:`layout_for_layer`).
        cp_group: the layer's context-parallel group (None or size 1: no split).

    Returns:
        The shared :class:`ContextParallelLayout` (its ``queries`` None without CP).

    Raises:
        ValueError / NotImplementedError: a mask or packed_seq_params the layer cannot use,
            naming the argument.
    """
    if packed_seq_params is not None:
        return _thd_layout(
            packed_seq_params, attention_mask, batch_size, seq_len, device, topology, cp_group
        )
    cp_size = cp_group.size() if cp_group is not None else 1
    if cp_size == 1:
        msa = layout_for_layer(attention_mask, batch_size, seq_len, device, topology)
        return _single_rank_view(msa)
    _check_mask_device(attention_mask, device)
    if attention_mask is not None and attention_mask.dim() == 4:
        expected = (batch_size, 1, seq_len * cp_size, seq_len * cp_size)
        if tuple(attention_mask.shape) != expected:
            raise ValueError(
                f"attention_mask (4-D) has shape {tuple(attention_mask.shape)}; under context "
                f"parallelism it must be the global block-causal mask {expected}"
            )
    return ContextParallelLayout.build(
        attention_mask, group=cp_group, batch_size=batch_size, seq_len_local=seq_len,
        device=device, **_layout_fields(topology),
    )


# The full table of each rank's slice (the slice is Megatron's, cached by RotaryEmbedding).
_FULL_TABLES = TensorMemo()


def full_rotary_table(table: torch.Tensor, cp: ContextParallelLayout) -> torch.Tensor:
    """The rotary table of every position, from this rank's load-balanced slice of it.

    Under context parallelism GPTModel hands each layer its rank's rows of the rotary table
    (Megatron's ``get_pos_emb_on_this_cp_rank``: the angles of the rank's global columns), but a
    packed token needs the angle of its *document* position, which another rank's slice may
    hold. One all-gather (no gradient) rebuilds the table; it is cached on the slice, which
    Megatron's RotaryEmbedding returns from an lru_cache, so it runs once per sequence length.

    Args:
        table: [S / N, rot_dim] this rank's slice.
        cp: the microbatch's context-parallel layout.

    Returns:
        [S, rot_dim], row p the angles of position p.
    """
    full = _FULL_TABLES.get(table)
    if full is None:
        with torch.no_grad():
            full = gather_from_context_parallel(table, 0, cp.group, cp.order)
        _FULL_TABLES.put(table, None, full)
    return full
