"""The per-microbatch MSA layout: compact tokens, documents and the aligned workspace.

One :class:`MSAMicrobatch` describes where every real token of a packed [batch, sequence] batch
lives in three coordinate systems:

- compact: the real tokens in row-major document order, ``[tokens, ...]``; documents are
  contiguous, so key j of document d is compact row ``cu_seqlens[d] + j``;
- document-local: ``document_positions`` (the position inside its document);
- aligned workspace: each document starts at a multiple of ``block_size``, so block b of a
  document is rows ``[start + block_size * b, start + block_size * (b + 1))``.

Building a layout costs exactly one device-to-host synchronization. :meth:`MSAMicrobatch.build`
memoizes the layout on the identity and ``_version`` of the source tensor (normally
``packed_seq_ids``), so every attention layer and every virtual-pipeline chunk of a rank that
receives the same batch tensor shares one layout; the entry dies with the tensor.

The memo sees in-place writes through the tensor (``ids[0, 5] = 2``, ``ids.fill_(1)``,
``ids.copy_(...)``): they bump ``_version`` and the next ``build`` derives a new layout. Writes
that bypass autograd's version counter do not: through ``ids.data``, ``ids.detach()``'s storage,
``ids.numpy()`` or any other view that shares the storage without sharing the counter. After
such a write ``build`` returns the layout of the old contents. Give the layers a new tensor per
microbatch (as the loaders do), or write through the tensor itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nemo_msa.document_map import (
    document_map_from_source,
    select_document_map_source,
    summarize_document_map,
)
from nemo_msa.limits import SUPPORTED_BLOCK_SIZES, require_integer
from nemo_msa.tensor_memo import TensorMemo
from nemo_msa.triton.kernel_layout import build_kernel_layout


def query_rows(values: torch.Tensor, queries: torch.Tensor | None) -> torch.Tensor:
    """A per-token table [T, ...] read at the query subset: ``values[queries]`` [Tq, ...], or
    ``values`` itself when ``queries`` is None (every token is a query)."""
    return values if queries is None else values[queries]


def validate_queries(queries: torch.Tensor | None, msa: MSAMicrobatch, rows: int) -> None:
    """Checks a query subset against the layout and the query-side tensors' row count.

    ``queries`` (int64 [Tq]) are global compact rows of the layout, ascending and unique (the
    caller's promise, not checked: that would cost a host synchronization); None means every
    token.

    Raises:
        ValueError: ``queries`` not int64 1-D, on another device, longer than the layout's
            tokens, or disagreeing with the query-side tensors' ``rows``; or, with None,
            ``rows`` other than the layout's ``num_tokens``.
    """
    if queries is None:
        if rows != msa.num_tokens:
            raise ValueError(
                f"the query-side tensors have {rows} rows but the layout has num_tokens="
                f"{msa.num_tokens}; pass queries= (int64 [rows]) for a query subset"
            )
        return
    if not isinstance(queries, torch.Tensor) or queries.dtype != torch.int64 or queries.dim() != 1:
        raise ValueError(
            f"queries must be an int64 [Tq] tensor of global compact rows; got "
            f"{getattr(queries, 'dtype', type(queries))} "
            f"{tuple(getattr(queries, 'shape', ()))}"
        )
    if queries.shape[0] != rows or rows > msa.num_tokens:
        raise ValueError(
            f"queries has {queries.shape[0]} rows; expected the query-side tensors' {rows} "
            f"(at most the layout's num_tokens={msa.num_tokens})"
        )
    if queries.device != msa.device:
        raise ValueError(f"queries is on {queries.device}; the layout is on {msa.device}")


def _check_forced_blocks(block_size: int, init_blocks: int, local_blocks: int) -> None:
    require_integer("block_size", block_size)
    require_integer("init_blocks", init_blocks)
    require_integer("local_blocks", local_blocks)
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block_size={block_size} is not supported; expected one of {SUPPORTED_BLOCK_SIZES}"
        )
    if init_blocks < 0:
        raise ValueError(f"init_blocks={init_blocks}; expected >= 0")
    if local_blocks < 0:
        raise ValueError(f"local_blocks={local_blocks}; expected >= 0")


_MEMO = TensorMemo()
# Layouts of batches with no document-map source, keyed by shape and device (bounded).
_NO_SOURCE_CACHE: dict[tuple, MSAMicrobatch] = {}
_BUILD_COUNT = 0


@dataclass(eq=False)
class MSAMicrobatch:
    """Layout of one packed microbatch, shared by every MSA layer that sees the same batch.

    Attributes:
        batch_size: b.
        seq_len: s.
        block_size: key-block size (128 in production).
        forced_blocks: ``(init_blocks, local_blocks)`` the selection always keeps.
        padding_mask: bool [b, s], True marks padding (Megatron's convention).
        token_rows: int64 [T], flat index ``row * s + column`` of each real token.
        token_documents: int32 [T], document index (0..D-1, row-major order) of each token.
        document_positions: int32 [T], position of each token inside its document.
        workspace_positions: int64 [T], row of each token in the aligned workspace.
        document_workspace_starts: int64 [D], first workspace row of each document (a multiple
            of ``block_size``).
        cu_seqlens: int32 [D + 1], compact start of each document, then T.
        num_tokens: T, host int.
        num_documents: D, host int.
        workspace_size: rows of the aligned workspace, host int (a multiple of block_size).
        max_seqlen: longest document, host int.
        document_lengths: the D document lengths in compact order, host ints (read in the
            build's one synchronization; host-side plans such as per-document dense attention
            use them without touching the device).
    """

    batch_size: int
    seq_len: int
    block_size: int
    forced_blocks: tuple[int, int]
    padding_mask: torch.Tensor
    token_rows: torch.Tensor
    token_documents: torch.Tensor
    document_positions: torch.Tensor
    workspace_positions: torch.Tensor
    document_workspace_starts: torch.Tensor
    cu_seqlens: torch.Tensor
    num_tokens: int
    num_documents: int
    workspace_size: int
    max_seqlen: int
    document_lengths: tuple[int, ...] = ()
    _cache: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        packed_seq_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        *,
        batch_size: int | None = None,
        seq_len: int | None = None,
        device: torch.device | str | None = None,
        block_size: int = 128,
        init_blocks: int = 0,
        local_blocks: int = 1,
    ) -> MSAMicrobatch:
        """Returns the layout of a batch, built once per source tensor (memoized).

        The source is the first of ``packed_seq_ids``, ``attention_mask`` (2-D ids or bool 4-D
        block-causal), ``padding_mask`` (True = padding) present; with none, every row is one
        document of ``seq_len`` tokens. The memo keys on the source tensor's identity and
        ``_version``: an in-place write to the tensor forces a rebuild, and the entry is dropped
        when the tensor is freed. Writes through ``.data``, ``.numpy()`` or ``.detach()`` do not
        bump ``_version`` and so return the stale layout (see the module docstring).

        Args:
            packed_seq_ids: int [b, s] document ids, 0 = padding (a bool tensor is refused:
                for a bool padding mask pass ``padding_mask``).
            attention_mask: int [b, s] document ids, or bool [b, 1, s, s] (True = keep).
            padding_mask: bool [b, s], True = padding.
            batch_size: b; required with no source, checked otherwise.
            seq_len: s; likewise.
            device: device of the layout when there is no source.
            block_size: key-block size.
            init_blocks: forced sink blocks at each document start.
            local_blocks: forced blocks ending at the query's own block.

        Returns:
            The shared layout.

        Raises:
            ValueError: for a malformed document map (see nemo_msa.document_map), a bool
                ``packed_seq_ids``, or a non-integer ``block_size`` / ``init_blocks`` /
                ``local_blocks`` (32.0 included).
        """
        _check_forced_blocks(block_size, init_blocks, local_blocks)
        source = select_document_map_source(packed_seq_ids, attention_mask, padding_mask)
        params = (block_size, init_blocks, local_blocks)
        memo_tensor = source.tensor
        if memo_tensor is not None:
            key = (source.name, *params)
            cached = _MEMO.get(memo_tensor, key)
        else:
            # No source: the layout depends only on the shape and device (no sync to save, but
            # every layer should still share one object).
            key = ("none", *params, batch_size, seq_len, str(device))
            cached = _NO_SOURCE_CACHE.get(key)
        if cached is not None:
            return cached

        document_map, bad_mask_row = document_map_from_source(source, batch_size, seq_len, device)
        layout = cls._from_map(
            document_map, bad_mask_row, block_size, (init_blocks, local_blocks), source.name
        )
        if memo_tensor is not None:
            _MEMO.put(memo_tensor, key, layout)
        else:
            if len(_NO_SOURCE_CACHE) > 64:
                _NO_SOURCE_CACHE.clear()
            _NO_SOURCE_CACHE[key] = layout
        return layout

    @classmethod
    def from_document_map(
        cls,
        document_map: torch.Tensor,
        *,
        block_size: int = 128,
        init_blocks: int = 0,
        local_blocks: int = 1,
    ) -> MSAMicrobatch:
        """Builds a layout from an int [b, s] document map, without memoizing it.

        Args:
            document_map: int [b, s]; 0 = padding, each positive id one contiguous run per row.
            block_size: key-block size.
            init_blocks: forced sink blocks.
            local_blocks: forced local blocks.

        Returns:
            A new layout.
        """
        _check_forced_blocks(block_size, init_blocks, local_blocks)
        source = select_document_map_source(packed_seq_ids=document_map)
        document_map, bad = document_map_from_source(source, None, None)
        return cls._from_map(
            document_map, bad, block_size, (init_blocks, local_blocks), "document_map"
        )

    @classmethod
    def _from_map(
        cls,
        document_map: torch.Tensor,
        bad_mask_row: torch.Tensor,
        block_size: int,
        forced_blocks: tuple[int, int],
        source_name: str,
    ) -> MSAMicrobatch:
        global _BUILD_COUNT
        b, s = document_map.shape
        summary, parts = summarize_document_map(document_map, bad_mask_row, block_size, source_name)
        real, starts, local_positions = parts["real"], parts["starts"], parts["local_positions"]
        tokens, documents = summary.num_tokens, summary.num_documents

        # Stable argsort puts the real tokens first in their row-major order: a gather index with
        # a size known on the host, so no further synchronization (unlike nonzero()).
        token_rows = torch.argsort((~real).to(torch.int8), stable=True)[:tokens]
        document_of_flat = torch.cumsum(starts.to(torch.int64), dim=0) - 1
        token_documents = document_of_flat[token_rows].to(torch.int32)
        document_positions = local_positions[token_rows]
        compact_starts = torch.argsort((document_positions != 0).to(torch.int8), stable=True)
        # The end offset is filled on the device (torch.tensor(..., device=cuda) would sync).
        cu_seqlens = torch.cat([compact_starts[:documents], compact_starts.new_full((1,), tokens)])
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        blocks = (lengths + block_size - 1) // block_size
        workspace_starts = (torch.cumsum(blocks, dim=0) - blocks) * block_size
        workspace_positions = workspace_starts[token_documents.long()] + document_positions

        _BUILD_COUNT += 1
        return cls(
            batch_size=b,
            seq_len=s,
            block_size=block_size,
            forced_blocks=forced_blocks,
            padding_mask=~real.reshape(b, s),
            token_rows=token_rows,
            token_documents=token_documents,
            document_positions=document_positions.to(torch.int32),
            workspace_positions=workspace_positions,
            document_workspace_starts=workspace_starts,
            cu_seqlens=cu_seqlens.to(torch.int32),
            num_tokens=tokens,
            num_documents=documents,
            workspace_size=summary.num_workspace_blocks * block_size,
            max_seqlen=summary.max_seqlen,
            document_lengths=summary.document_lengths,
        )

    @staticmethod
    def num_builds() -> int:
        """How many layouts this process has built (memo hits do not count)."""
        return _BUILD_COUNT

    @staticmethod
    def memo_size() -> int:
        """How many source tensors currently hold a memoized layout."""
        return len(_MEMO)

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.token_rows.device

    @property
    def num_workspace_blocks(self) -> int:
        return self.workspace_size // self.block_size

    def checked_document_lengths(self) -> tuple[int, ...]:
        """The host document lengths, the plans' input (per-document dense calls, the kernels'
        layout view), checked against the host sizes.

        Raises:
            ValueError: a layout without host lengths (built by hand, not by :meth:`build`), or
                lengths that do not add up to ``num_documents`` / ``num_tokens``.
        """
        lengths = self.document_lengths
        if len(lengths) != self.num_documents or sum(lengths) != self.num_tokens:
            raise ValueError(
                f"msa.document_lengths holds {len(lengths)} lengths summing to {sum(lengths)}; "
                f"expected num_documents={self.num_documents} lengths summing to num_tokens="
                f"{self.num_tokens} (build the layout with MSAMicrobatch.build)"
            )
        return lengths

    def cached(self, name: str, make):
        """Returns a derived tensor computed once per layout (shared by all layers)."""
        value = self._cache.get(name)
        if value is None:
            value = make()
            self._cache[name] = value
        return value

    def kernel_layout(self, block_size: int | None = None):
        """The Triton kernels' typed view of this layout for ``block_size`` (default: the
        layout's), built once and shared by every layer
        (:class:`nemo_msa.triton.kernel_layout.KernelLayout`)."""
        bs = self.block_size if block_size is None else int(block_size)
        return self.cached(f"triton_kernel_layout_{bs}", lambda: build_kernel_layout(self, bs))

    @property
    def token_document_starts(self) -> torch.Tensor:
        """int64 [T]: compact row of the first token of each token's document."""
        return self.cached(
            "token_document_starts",
            lambda: self.cu_seqlens.long()[self.token_documents.long()],
        )

    @property
    def token_workspace_block_starts(self) -> torch.Tensor:
        """int64 [T]: workspace block index of block 0 of each token's document."""
        return self.cached(
            "token_workspace_block_starts",
            lambda: self.document_workspace_starts[self.token_documents.long()]
            // self.block_size,
        )

    def _workspace_table(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """int64 [W]: ``values`` [T] placed at each token's workspace row, -1 in the gaps."""

        def make() -> torch.Tensor:
            rows = torch.full((self.workspace_size,), -1, dtype=torch.int64, device=self.device)
            rows[self.workspace_positions] = values.long()
            return rows

        return self.cached(name, make)

    @property
    def workspace_documents(self) -> torch.Tensor:
        """int64 [W]: document of each workspace row, -1 for rows past a document's end."""
        return self._workspace_table("workspace_documents", self.token_documents)

    @property
    def workspace_positions_in_document(self) -> torch.Tensor:
        """int64 [W]: document-local position of each workspace row, -1 past a document's end."""
        return self._workspace_table("workspace_positions_in_document", self.document_positions)

    # ------------------------------------------------------------------ data movement
    def _check_bs(self, name: str, x: torch.Tensor) -> None:
        if x.dim() < 2 or x.shape[0] != self.batch_size or x.shape[1] != self.seq_len:
            raise ValueError(
                f"{name} must be [batch={self.batch_size}, sequence={self.seq_len}, ...]; got "
                f"shape {tuple(x.shape)}"
            )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Gathers the real tokens: [b, s, ...] -> [T, ...] in row-major document order."""
        self._check_bs("x", x)
        return x.reshape(self.batch_size * self.seq_len, *x.shape[2:])[self.token_rows]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Scatters compact tokens back: [T, ...] -> [b, s, ...], zeros at padding."""
        if x.dim() < 1 or x.shape[0] != self.num_tokens:
            raise ValueError(
                f"x must be [tokens={self.num_tokens}, ...]; got shape {tuple(x.shape)}"
            )
        out = x.new_zeros(self.batch_size * self.seq_len, *x.shape[1:])
        out = out.index_copy(0, self.token_rows, x)
        return out.reshape(self.batch_size, self.seq_len, *x.shape[1:])

    def to_workspace(self, x: torch.Tensor) -> torch.Tensor:
        """Places compact tokens in the aligned workspace: [T, ...] -> [W, ...], zero gaps."""
        if x.dim() < 1 or x.shape[0] != self.num_tokens:
            raise ValueError(
                f"x must be [tokens={self.num_tokens}, ...]; got shape {tuple(x.shape)}"
            )
        out = x.new_zeros(self.workspace_size, *x.shape[1:])
        return out.index_copy(0, self.workspace_positions, x)

    def from_workspace(self, x: torch.Tensor) -> torch.Tensor:
        """Reads compact tokens out of the workspace: [W, ...] -> [T, ...]."""
        if x.dim() < 1 or x.shape[0] != self.workspace_size:
            raise ValueError(
                f"x must be [workspace={self.workspace_size}, ...]; got shape {tuple(x.shape)}"
            )
        return x[self.workspace_positions]

    def position_ids(self) -> torch.Tensor:
        """int64 [b, s]: per-document positions (restart at 0 for every document), 0 at padding.

        These are the RoPE positions of packed documents. A new tensor on every call (one
        scatter, no host synchronization): the layout is shared by every layer of the
        microbatch, so a cached tensor handed out could be written in place by one caller and
        read changed by the next (torch has no read-only tensors).
        """
        return self.unpack(self.document_positions.long())
