"""The per-microbatch context-parallel layout: the global layout, this rank's queries, the maps.

Under context parallelism (N ranks) a Megatron layer holds ``[s_local, b, ...]`` activations of
its 2 load-balanced chunks per row (``s_local = S / N``). :class:`ContextParallelLayout` ties
them to the *global* :class:`nemo_msa.MSAMicrobatch` (of the whole [b, S] document map or THD
pack, the same on every rank):

- ``queries``: int64 [Tq], the global compact rows of this rank's real tokens, ascending (the
  query subset the ops take);
- :meth:`pack_local` / :meth:`unpack_local`: ``[s_local, b, ...] <-> [Tq, ...]``;
- :meth:`gather`: this rank's compact ``[Tq, ...]`` K, V or index_k -> every token's ``[T, ...]``
  in the global compact order, through the differentiable all-gather (backward: reduce-scatter).

With N = 1 ``queries`` is None and the maps are the layout's own (the unsplit path, unchanged).
A layout is built once per microbatch and memoized on the source tensor (the document ids, or the
THD ``cu_seqlens``) like :meth:`nemo_msa.MSAMicrobatch.build`, so every layer and virtual stage
of a rank shares it. Local document ids [b, S / N] are all-gathered once per microbatch (the only
collective for the layout); global ids [b, S] need none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nemo_msa.context_parallel.comm import gather_from_context_parallel
from nemo_msa.context_parallel.indices import (
    gather_order,
    load_balanced_indices,
    thd_load_balanced_indices,
)
from nemo_msa.layout import MSAMicrobatch
from nemo_msa.query_view import QueryView
from nemo_msa.tensor_memo import TensorMemo

__all__ = ["ContextParallelLayout", "thd_document_map"]

_CP_MEMO = TensorMemo()
_NO_SOURCE: dict[tuple, ContextParallelLayout] = {}


def _group_size_rank(group) -> tuple[int, int]:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


@dataclass(eq=False)
class ContextParallelLayout:
    """One rank's view of a microbatch under context parallelism.

    Attributes:
        msa: the global layout (every CP rank builds the same).
        queries: int64 [Tq] global compact rows of this rank's real tokens (ascending), or None
            with N = 1 (every token).
        local_rows: int64 [Tq] row of each local query in the ``[s_local * b]`` flattening of
            this rank's Megatron tensors.
        order: int64 [N * s_local] global column of each row of an all-gather over the group.
        seq_len_local: s_local.
        batch_size: b.
        cp_size: N.
        cp_rank: this rank.
        group: the CP process group (None with N = 1).
        rows_in_order: ``local_rows`` is ``0..Tq-1`` (N = 1, one row, no padding): the compact
            tokens are the Megatron tensors' own rows, so :meth:`pack_local` and
            :meth:`unpack_local` reshape instead of gathering and scattering.
        view: ``msa`` with ``queries`` (:class:`nemo_msa.query_view.QueryView`), what the layer
            hands the ops: built once, with the layout.
    """

    msa: MSAMicrobatch
    queries: torch.Tensor | None
    local_rows: torch.Tensor
    order: torch.Tensor
    seq_len_local: int
    batch_size: int
    cp_size: int
    cp_rank: int
    group: object = None
    rows_in_order: bool = False
    _keep: object = field(default=None, repr=False)
    view: QueryView = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.view = QueryView(self.msa, self.queries)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_global(
        cls,
        msa: MSAMicrobatch,
        local_indices: torch.Tensor,
        order: torch.Tensor,
        cp_size: int,
        cp_rank: int,
        group=None,
    ) -> ContextParallelLayout:
        """Rank ``cp_rank``'s view of a global layout, not memoized.

        Without a group (``group=None``) everything but :meth:`gather` works: how tests and the
        per-rank benchmark simulate a rank in one process.

        Args:
            msa: the global layout ([b, S], or [1, P] for THD).
            local_indices: int64 [s_local] global column of each local position
                (:func:`load_balanced_indices` / :func:`thd_load_balanced_indices`).
            order: int64 [N * s_local], every rank's local indices in rank order.
            cp_size: N.
            cp_rank: r.
            group: the CP process group, or None.

        Returns:
            The rank's layout.
        """
        s, b = msa.seq_len, msa.batch_size
        column_to_local = torch.full((s,), -1, dtype=torch.int64, device=msa.device)
        column_to_local[local_indices] = torch.arange(
            local_indices.shape[0], dtype=torch.int64, device=msa.device
        )
        rows = msa.token_rows
        local_position = column_to_local[rows % s]
        flat = local_position * b + rows // s
        if cp_size == 1:
            queries = None
        else:
            # One host synchronization per microbatch (the count of local real tokens).
            queries = torch.nonzero(local_position >= 0).squeeze(1)
            flat = flat[queries]
        return cls(
            msa=msa,
            queries=queries,
            local_rows=flat,
            order=order,
            seq_len_local=local_indices.shape[0],
            batch_size=b,
            cp_size=cp_size,
            cp_rank=cp_rank,
            group=group if cp_size > 1 else None,
            # flat = token_rows here, which is 0..T-1 when one row has no padding.
            rows_in_order=cp_size == 1 and b == 1 and msa.num_tokens == s,
        )

    @classmethod
    def build(
        cls,
        document_ids: torch.Tensor | None,
        *,
        group,
        batch_size: int,
        seq_len_local: int,
        device: torch.device | str,
        block_size: int = 128,
        init_blocks: int = 0,
        local_blocks: int = 1,
    ) -> ContextParallelLayout:
        """The layout of a BSHD microbatch split Megatron's load-balanced way (memoized).

        Args:
            document_ids: int [b, S] global document ids (0 = padding), int [b, S / N] this
                rank's local ids (gathered once), bool [b, 1, S, S] global block-causal (True =
                keep), or None (every row one document of S tokens).
            group: the CP process group (None or size 1: no split).
            batch_size: b.
            seq_len_local: s_local = S / N, the activations' sequence length on this rank.
            device: the activations' device.
            block_size, init_blocks, local_blocks: as :meth:`nemo_msa.MSAMicrobatch.build`.

        Returns:
            The shared layout.

        Raises:
            ValueError: ids whose shape is neither global nor local.
        """
        cp_size, cp_rank = _group_size_rank(group)
        seq = seq_len_local * cp_size
        params = (block_size, init_blocks, local_blocks)
        key = ("bshd", cp_size, cp_rank, id(group), batch_size, seq_len_local, *params)
        if document_ids is None:
            key = (*key, str(device))
            cached = _NO_SOURCE.get(key)
        else:
            cached = _CP_MEMO.get(document_ids, key)
        if cached is not None:
            return cached
        all_local = [load_balanced_indices(seq, cp_size, r, device=device) for r in range(cp_size)]
        order = gather_order(all_local)
        keep = None
        if document_ids is not None and document_ids.dim() == 2:
            shape = tuple(document_ids.shape)
            if shape == (batch_size, seq_len_local) and cp_size > 1:
                global_ids = gather_from_context_parallel(document_ids, 1, group, order)
                keep = global_ids
                msa = MSAMicrobatch.from_document_map(
                    global_ids, block_size=block_size, init_blocks=init_blocks,
                    local_blocks=local_blocks,
                )
            elif shape == (batch_size, seq):
                msa = MSAMicrobatch.build(
                    document_ids, block_size=block_size, init_blocks=init_blocks,
                    local_blocks=local_blocks,
                )
            else:
                raise ValueError(
                    f"attention_mask (document ids) has shape {shape}; expected the global "
                    f"[batch={batch_size}, sequence={seq}] or, under context parallelism, this "
                    f"rank's [batch={batch_size}, sequence={seq_len_local}]"
                )
        else:
            msa = MSAMicrobatch.build(
                attention_mask=document_ids, batch_size=batch_size, seq_len=seq, device=device,
                block_size=block_size, init_blocks=init_blocks, local_blocks=local_blocks,
            )
        layout = cls.from_global(msa, all_local[cp_rank], order, cp_size, cp_rank, group)
        layout._keep = keep
        if document_ids is None:
            if len(_NO_SOURCE) > 64:
                _NO_SOURCE.clear()
            _NO_SOURCE[key] = layout
        else:
            _CP_MEMO.put(document_ids, key, layout)
        return layout

    @classmethod
    def build_thd(
        cls,
        cu_seqlens: torch.Tensor,
        cu_seqlens_padded: torch.Tensor | None,
        *,
        group,
        device: torch.device | str,
        block_size: int = 128,
        init_blocks: int = 0,
        local_blocks: int = 1,
    ) -> ContextParallelLayout:
        """The layout of a THD pack (``packed_seq_params``), split per sequence (memoized on the
        padded ``cu_seqlens`` tensor, else on ``cu_seqlens``).

        The pack is one row of ``cu_seqlens_padded[-1]`` tokens: sequence i (document i + 1)
        holds rows ``[padded_start_i, padded_start_i + length_i)``, the rest up to the next
        padded start is padding.

        Args:
            cu_seqlens: int32 [D + 1] real sequence starts (cu_seqlens_q).
            cu_seqlens_padded: int32 [D + 1] padded starts (cu_seqlens_q_padded), or None (no
                padding).
            group: the CP process group.
            device: the activations' device.
            block_size, init_blocks, local_blocks: as :meth:`nemo_msa.MSAMicrobatch.build`.

        Returns:
            The shared layout (batch 1, the activations [t_local, 1, ...]).
        """
        cp_size, cp_rank = _group_size_rank(group)
        source = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        key = ("thd", cp_size, cp_rank, id(group), id(cu_seqlens), block_size, init_blocks,
               local_blocks)
        cached = _CP_MEMO.get(source, key)
        if cached is not None:
            return cached
        ids = thd_document_map(cu_seqlens.to(device), source.to(device))
        msa = MSAMicrobatch.from_document_map(
            ids, block_size=block_size, init_blocks=init_blocks, local_blocks=local_blocks
        )
        padded = source.to(device)
        all_local = [thd_load_balanced_indices(padded, cp_size, r) for r in range(cp_size)]
        layout = cls.from_global(
            msa, all_local[cp_rank], gather_order(all_local), cp_size, cp_rank, group
        )
        layout._keep = cu_seqlens
        _CP_MEMO.put(source, key, layout)
        return layout

    # ------------------------------------------------------------------ data movement
    @property
    def num_queries(self) -> int:
        """Tq: this rank's real tokens."""
        return self.local_rows.shape[0]

    def pack_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's real tokens of a Megatron ``[s_local, b, ...]`` tensor -> ``[Tq, ...]``
        (ascending global compact order)."""
        if x.dim() < 2 or x.shape[0] != self.seq_len_local or x.shape[1] != self.batch_size:
            raise ValueError(
                f"x must be [sequence={self.seq_len_local}, batch={self.batch_size}, ...]; got "
                f"shape {tuple(x.shape)}"
            )
        flat = x.reshape(self.seq_len_local * self.batch_size, *x.shape[2:])
        if self.rows_in_order:
            # A gather of every row in order is a copy, and its backward a zero fill plus an
            # accumulating scatter; contiguous() keeps the gather's output layout for less.
            return flat.contiguous()
        return flat[self.local_rows]

    def unpack_local(self, x: torch.Tensor) -> torch.Tensor:
        """``[Tq, ...]`` -> ``[s_local, b, ...]``, zeros at padding (differentiable)."""
        if x.dim() < 1 or x.shape[0] != self.num_queries:
            raise ValueError(f"x must be [tokens={self.num_queries}, ...]; got {tuple(x.shape)}")
        if self.rows_in_order:
            return x.reshape(self.seq_len_local, self.batch_size, *x.shape[1:])
        out = x.new_zeros(self.seq_len_local * self.batch_size, *x.shape[1:])
        out = out.index_copy(0, self.local_rows, x)
        return out.view(self.seq_len_local, self.batch_size, *x.shape[1:])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's compact ``[Tq, ...]`` -> every rank's, ``[T, ...]`` in the global compact
        order; the backward reduce-scatters the gradient (the identity with N = 1)."""
        if self.cp_size == 1:
            return x
        full = gather_from_context_parallel(self.unpack_local(x), 0, self.group, self.order)
        return self.msa.pack(full.transpose(0, 1))


def thd_document_map(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """int64 [1, P] document ids of a THD pack (P = ``cu_seqlens_padded[-1]``): sequence i's
    real tokens are i + 1, the gap between its real and padded end 0 (padding).

    Args:
        cu_seqlens: int [D + 1] real starts (``cu_seqlens[i + 1] - cu_seqlens[i]`` = length).
        cu_seqlens_padded: int [D + 1] padded starts (``cu_seqlens`` itself without padding).

    Raises:
        ValueError: shapes that differ, or a real length longer than its padded length.
    """
    if cu_seqlens.shape != cu_seqlens_padded.shape or cu_seqlens.dim() != 1:
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q {tuple(cu_seqlens.shape)} and cu_seqlens_q_padded "
            f"{tuple(cu_seqlens_padded.shape)} must both be [num_sequences + 1]"
        )
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    padded = cu_seqlens_padded.long()
    if bool((lengths > padded[1:] - padded[:-1]).any()):
        raise ValueError(
            "packed_seq_params: a sequence is longer in cu_seqlens_q than in "
            "cu_seqlens_q_padded (real lengths must not exceed the padded ones)"
        )
    total = int(padded[-1])
    rows = torch.arange(total, device=padded.device)
    sequence = torch.searchsorted(padded[1:], rows, right=True)
    real = rows - padded[sequence] < lengths[sequence]
    return torch.where(real, sequence + 1, 0).view(1, total)
