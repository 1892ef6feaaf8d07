"""Which queries of a microbatch MSA computes densely: the host plan of the dense dispatch.

A query at document position p has ``p // block + 1`` candidate blocks (0..own block). Where that
is at most top_k, a top-k selection holds every candidate (forced blocks count inside top_k, and
NaN scores still fill a free slot), so its sparse attention is exactly dense causal attention
over its document's first p + 1 keys. Those queries are the document prefixes
``[0, min(length, top_k * block))``; a document of at most ``top_k * block`` tokens (2048 for
MiniMax-M3) is all prefix. The layer's core attention runs the prefixes on the dense path (one
SDPA per run of equal-length prefixes, :func:`nemo_msa.attention.dense.dense_attention_runs`:
cuDNN on the GPU) and the other queries on the sparse kernels (ADR 0026).

The plan is built once per (layout, top_k) from the layout's host document lengths, with no
device-to-host synchronization, and kept on the layout, so every layer of the microbatch shares
it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nemo_msa.attention.dense import DocumentRun, dense_attention_runs, padded_length
from nemo_msa.attention.finite import (
    finite_keys_and_values_of_documents,
    mark_attending_rows,
)
from nemo_msa.layout import MSAMicrobatch
from nemo_msa.triton.kernel_layout import query_subset

__all__ = [
    "MIN_PREFIX_SHARE",
    "DenseDispatch",
    "dense_dispatch",
    "dispatched_attention",
    "prefix_share",
]

#: The dispatch runs where the prefix queries hold at least this share of the sparse path's
#: (query, key) pairs. It saves that share of the sparse kernels' time less the dense path's
#: (cuDNN does the same pairs in roughly 0.4x the time on the H200) and, with the indexer loss
#: on, the prefixes' mass forward (about a quarter of their sparse time); it costs the gathers
#: and the merge (a read and a write of q and of the output per direction, about 5 ms per layer
#: at 131072 tokens). That model breaks even near 9% with the loss on (5% off): one document
#: of 131072 tokens has 0.8% of its pairs in its first 2048 queries, one of 32768 tokens 3.2%,
#: one of 8192 tokens 14%; rows packed as scripts/bench_layer.py packs them: 32768 tokens of
#: mean 4096 about 28% (10-60% per row), 131072 of mean 16384 about 7% (2-15%). Either side of
#: it the function is the same.
MIN_PREFIX_SHARE = 0.1


@dataclass(frozen=True, eq=False)
class DenseDispatch:
    """The split of a layout's queries into document prefixes (dense) and the rest (sparse).

    Attributes:
        limit: ``top_k * block_size``: positions below it hold every candidate block.
        order: int64 [T]: the dense rows (ascending), then the sparse rows (ascending).
        dense_rows: int64 [Td]: ``order[:Td]``, compact rows of the prefix queries.
        sparse_rows: int64 [Ts]: ``order[Td:]``, compact rows of the other queries.
        merge: int64 [T]: the row of each compact token in ``order`` (its inverse), so that
            ``torch.cat([dense_out, sparse_out])[merge]`` is in compact order.
        dense_runs: runs of equal-length prefixes over the gathered dense rows (a prefix's
            keys are its own rows, so the gathered rows are documents of their own).
        num_dense: Td (host int).
        num_sparse: Ts (host int).
        in_order: every dense row comes before every sparse row (only the layout's last
            document is longer than ``limit``: one document per microbatch among others), so
            ``order`` is the identity and the split and merge are slices and a concatenation.
        dense_tiles: per tile size ``qt`` (powers of two up to the block size), the number of
            ``qt``-token tiles of the full launch that hold a dense row (host ints).
        dense_first_rows: int64 [Td]: each gathered dense row's first row among the gathered
            rows (its prefix's start), for the NaN/Inf containment of the dense call.
        sparse_tiles: the same for the sparse rows.
    """

    limit: int
    order: torch.Tensor
    dense_rows: torch.Tensor
    sparse_rows: torch.Tensor
    merge: torch.Tensor
    dense_runs: tuple[DocumentRun, ...]
    num_dense: int
    num_sparse: int
    in_order: bool
    dense_tiles: dict[int, int]
    sparse_tiles: dict[int, int]
    dense_first_rows: torch.Tensor


def _prefix_first_rows(runs: tuple[DocumentRun, ...], device: torch.device) -> torch.Tensor:
    """int64 [Td]: each gathered prefix row's first row (the runs cover the rows in order)."""
    parts = [run.start + torch.arange(run.count * run.length, device=device) // run.length
             * run.length for run in runs]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _tile_counts(lengths: tuple[int, ...], limit: int, block: int) -> tuple[dict, dict]:
    """Tiles holding a dense / a sparse row, per tile size: a document's dense rows are
    positions [0, min(L, limit)), its sparse rows [limit, L); ``limit`` is a multiple of every
    tile size, so no tile holds both."""
    sizes = [1 << i for i in range(block.bit_length()) if (1 << i) <= block]
    dense = {qt: sum(-(-min(n, limit) // qt) for n in lengths) for qt in sizes}
    sparse = {qt: sum(-(-(n - limit) // qt) for n in lengths if n > limit) for qt in sizes}
    return dense, sparse


def prefix_share(lengths: tuple[int, ...], limit: int) -> float:
    """The share of the sparse path's causal (query, key) pairs that the prefix queries hold:
    a prefix of n queries has n (n + 1) / 2, a query past the limit attends ``limit`` keys."""
    dense = sum(min(n, limit) * (min(n, limit) + 1) // 2 for n in lengths)
    rest = sum(max(0, n - limit) * limit for n in lengths)
    return dense / max(1, dense + rest)


def dense_dispatch(
    msa: MSAMicrobatch, top_k: int, min_share: float = MIN_PREFIX_SHARE
) -> DenseDispatch | None:
    """The dense dispatch plan of ``msa`` for selections of ``top_k`` blocks (cached on the
    layout; no host synchronization: the counts come from its host document lengths).

    Args:
        msa: the microbatch layout (built by :meth:`MSAMicrobatch.build`, which records the
            document lengths on the host).
        top_k: blocks per query of the selection.
        min_share: the least :func:`prefix_share` that dispatches (see
            :data:`MIN_PREFIX_SHARE`).

    Returns:
        The plan, or None for a layout without host document lengths (built by hand) or whose
        prefixes hold less than ``min_share`` of the sparse work (all-sparse is then faster).
    """
    lengths = msa.document_lengths
    if len(lengths) != msa.num_documents or sum(lengths) != msa.num_tokens:
        return None

    def make() -> DenseDispatch | bool:
        block = msa.block_size
        limit = top_k * block
        if prefix_share(lengths, limit) < min_share:
            return False  # cached too: the share is read once per microbatch
        prefixes = [min(n, limit) for n in lengths]
        num_dense = sum(prefixes)
        # A stable sort of the "sparse" flag puts the dense rows first, each side ascending:
        # a gather index of host-known size, no nonzero() (which would synchronize).
        sparse = msa.document_positions >= limit
        order = torch.argsort(sparse.to(torch.int8), stable=True)
        merge = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.shape[0], device=order.device)
        )
        runs: list[DocumentRun] = []
        start = 0
        for n in prefixes:
            if runs and runs[-1].length == n:
                runs[-1] = DocumentRun(runs[-1].start, runs[-1].count + 1, n)
            else:
                runs.append(DocumentRun(start, 1, n))
            start += n
        dense_tiles, sparse_tiles = _tile_counts(lengths, limit, block)
        plan = DenseDispatch(
            limit=limit, order=order, dense_rows=order[:num_dense],
            sparse_rows=order[num_dense:], merge=merge, dense_runs=tuple(runs),
            num_dense=num_dense, num_sparse=msa.num_tokens - num_dense,
            in_order=all(n <= limit for n in lengths[:-1]),
            dense_tiles=dense_tiles, sparse_tiles=sparse_tiles,
            dense_first_rows=_prefix_first_rows(tuple(runs), msa.device),
        )
        # The kernels' query-subset views of both sides, built here from the host tile counts
        # (their own build would read the counts from the device: a synchronization).
        query_subset(msa, block, plan.dense_rows, dense_tiles)
        if plan.num_sparse:
            query_subset(msa, block, plan.sparse_rows, sparse_tiles)
        return plan

    plan = msa.cached(f"nemo_msa.attention.dense_dispatch_{int(top_k)}_{min_share}", make)
    return plan or None


class _SplitRows(torch.autograd.Function):
    """``x [T, ...] -> (x[dense_rows], x[sparse_rows])``; the backward writes each gradient
    once into one [T, ...] tensor (an index_select's backward would zero-fill and add)."""

    @staticmethod
    def forward(ctx, x, plan: DenseDispatch):
        ctx.plan = plan
        if plan.in_order:
            return x[: plan.num_dense], x[plan.num_dense :]
        return x.index_select(0, plan.dense_rows), x.index_select(0, plan.sparse_rows)

    @staticmethod
    def backward(ctx, grad_dense, grad_sparse):
        plan = ctx.plan
        if grad_dense is None:
            grad_dense = grad_sparse.new_zeros((plan.num_dense, *grad_sparse.shape[1:]))
        if grad_sparse is None:
            grad_sparse = grad_dense.new_zeros((plan.num_sparse, *grad_dense.shape[1:]))
        if plan.in_order:
            return torch.cat([grad_dense, grad_sparse]), None
        grad = grad_dense.new_empty((plan.num_dense + plan.num_sparse, *grad_dense.shape[1:]))
        grad.index_copy_(0, plan.dense_rows, grad_dense)
        grad.index_copy_(0, plan.sparse_rows, grad_sparse)
        return grad, None


class _MergeRows(torch.autograd.Function):
    """``(dense [Td, ...], sparse [Ts, ...]) -> [T, ...]`` in compact order (each row written
    once); the backward reads the two row sets back."""

    @staticmethod
    def forward(ctx, dense, sparse, plan: DenseDispatch, dim: int):
        ctx.plan, ctx.dim = plan, dim
        if plan.in_order:
            return torch.cat([dense, sparse], dim=dim)
        shape = list(dense.shape)
        shape[dim] = plan.num_dense + plan.num_sparse
        out = dense.new_empty(shape)
        out.index_copy_(dim, plan.dense_rows, dense)
        out.index_copy_(dim, plan.sparse_rows, sparse)
        return out

    @staticmethod
    def backward(ctx, grad):
        plan, dim = ctx.plan, ctx.dim
        if plan.in_order:
            dense, sparse = grad.split([plan.num_dense, plan.num_sparse], dim=dim)
        else:
            dense = grad.index_select(dim, plan.dense_rows)
            sparse = grad.index_select(dim, plan.sparse_rows)
        return dense, sparse, None, None


#: ``sparse(q_rows, q2k_rows, rows, return_block_mass)``: the sparse attention of a query
#: subset (``q_rows`` [Tq, Hq, d], ``q2k_rows`` [Hkv, Tq, top_k], global ``rows`` int64 [Tq])
#: against every token's keys; returns the output, and the block mass when asked.
SparseRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], object]


def dispatched_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q2k: torch.Tensor,
    plan: DenseDispatch,
    softmax_scale: float,
    sparse: SparseRows,
    return_block_mass: bool = False,
):
    """Attention over a top-k selection ``q2k``, split by ``plan``: the document prefixes on
    the dense path, the rest on ``sparse`` (a query subset). The same function and gradients
    as the sparse attention of every query; the prefixes' block mass (the sparse indexer
    loss's target; no gradient) is the sparse forward's on those rows, i.e. the dense
    attention's mass per visible block.

    Args:
        query: [T, Hq, d] compact queries.
        key: [T, Hkv, d] compact keys, query's dtype.
        value: [T, Hkv, d] compact values.
        q2k: int32 [Hkv, T, top_k], a top-k selection (every prefix query holds all its blocks).
        plan: :func:`dense_dispatch` of the layout for ``top_k``.
        softmax_scale: multiplies q.k.
        sparse: the sparse attention of a query subset (see :data:`SparseRows`).
        return_block_mass: also return the fp32 [Hkv, T, top_k] block mass.

    Returns:
        [T, Hq, d] in query's dtype; with ``return_block_mass`` the pair ``(output, mass)``.
    """
    dense_q, sparse_q = _SplitRows.apply(query, plan)
    # A prefix query sees only its prefix's keys, so the gathered prefixes are documents.
    dense_k = key[: plan.num_dense] if plan.in_order else key.index_select(0, plan.dense_rows)
    dense_v = value[: plan.num_dense] if plan.in_order else value.index_select(0, plan.dense_rows)
    # SDPA multiplies masked probabilities with K and V: it runs on finite copies, and the
    # prefix rows that attend a non-finite key or value are marked after (ADR 0025).
    dense_k, dense_v, reached = finite_keys_and_values_of_documents(
        dense_k, dense_v, plan.dense_first_rows)
    out = mark_attending_rows(dense_attention_runs(
        dense_q, dense_k, dense_v, plan.dense_runs, softmax_scale,
        pad_to=padded_length if query.is_cuda else None,
    ), reached)
    mass = None
    if return_block_mass:
        with torch.no_grad():
            _, mass = sparse(dense_q.detach(), q2k.index_select(1, plan.dense_rows),
                             plan.dense_rows, True)
    if plan.num_sparse == 0:
        return (out, mass) if return_block_mass else out
    sparse_out = sparse(sparse_q, q2k.index_select(1, plan.sparse_rows), plan.sparse_rows,
                        return_block_mass)
    if return_block_mass:
        sparse_out, sparse_mass = sparse_out
        mass = _MergeRows.apply(mass, sparse_mass, plan, 1)
    out = _MergeRows.apply(out, sparse_out, plan, 0)
    return (out, mass) if return_block_mass else out
