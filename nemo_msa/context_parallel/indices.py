"""Megatron's load-balanced context-parallel split: index maps and the data-side split.

With a context-parallel group of N ranks every sequence is cut into 2N equal chunks and rank r
keeps chunk r and chunk 2N-1-r (Megatron's ``get_batch_on_this_cp_rank`` for BSHD; for THD each
packed sequence is split that way on its own, TE's ``thd_get_partitioned_indices`` order), so
every rank holds as many early (cheap) as late (expensive) causal queries. Both chunks are
contiguous runs of the global order, so a rank's local order is ascending in the global one.
"""

from __future__ import annotations

import torch

__all__ = [
    "gather_order",
    "load_balanced_indices",
    "split_for_context_parallel",
    "thd_load_balanced_indices",
]


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r}; expected an int >= 1")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank!r}; expected an int in 0..{cp_size - 1}")


def load_balanced_indices(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global column of each local position of rank ``cp_rank`` (BSHD).

    Args:
        seq_len: S, the global sequence length (a multiple of 2 * cp_size when cp_size > 1).
        cp_size: N, the context-parallel size.
        cp_rank: r in 0..N-1.
        device: where to build the map.

    Returns:
        int64 [S / N]: chunk r's columns, then chunk 2N-1-r's, each ascending (every column in
        order for N = 1, whatever S).

    Raises:
        ValueError: ``seq_len`` not a multiple of ``2 * cp_size`` (N > 1), or a bad size/rank.
    """
    _check_rank(cp_size, cp_rank)
    if cp_size == 1 and seq_len >= 1:
        # Nothing is split: chunks 0 and 1 are the whole sequence in order, of any length.
        return torch.arange(seq_len, dtype=torch.int64, device=device)
    if seq_len < 1 or seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"seq_len={seq_len} is not a positive multiple of 2 * context_parallel_size = "
            f"{2 * cp_size} (Megatron's load-balanced split cuts it into 2N equal chunks)"
        )
    chunk = seq_len // (2 * cp_size)
    base = torch.arange(chunk, dtype=torch.int64, device=device)
    return torch.cat([base + cp_rank * chunk, base + (2 * cp_size - 1 - cp_rank) * chunk])


def thd_load_balanced_indices(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """The global row of each local token of rank ``cp_rank`` in a THD pack.

    Every (padded) sequence i of ``L_i`` tokens is cut into 2N chunks on its own; the rank keeps
    chunks r and 2N-1-r of each, sequence after sequence (TE's ``thd_get_partitioned_indices``).

    Args:
        cu_seqlens_padded: int [D + 1] padded sequence starts, then the pack's length; every
            ``L_i`` a multiple of 2 * cp_size when cp_size > 1 (one host synchronization reads
            it); with cp_size = 1 the rank holds every row in order, of any lengths.
        cp_size: N.
        cp_rank: r.

    Returns:
        int64 [sum_i L_i / N] on the tensor's device.

    Raises:
        ValueError: a sequence length not a multiple of 2N, or a bad size/rank.
    """
    _check_rank(cp_size, cp_rank)
    if cp_size == 1:
        # No split: sequences of any length (an odd one included) stay whole and in order.
        total = cu_seqlens_padded[-1].to(torch.int64)
        return torch.arange(int(total), dtype=torch.int64, device=cu_seqlens_padded.device)
    bounds = [int(x) for x in cu_seqlens_padded.tolist()]
    parts = []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        length = stop - start
        if length < 0 or length % (2 * cp_size) != 0:
            raise ValueError(
                f"cu_seqlens_q_padded gives sequence {index} {length} tokens; with "
                f"context_parallel_size={cp_size} every padded sequence must be a multiple of "
                f"{2 * cp_size} tokens"
            )
        if length:
            parts.append(load_balanced_indices(length, cp_size, cp_rank) + start)
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=cu_seqlens_padded.device)
    return torch.cat(parts).to(cu_seqlens_padded.device)


def gather_order(local_indices: list[torch.Tensor]) -> torch.Tensor:
    """int64 [S]: the global index of each row of an all-gather (rank 0's rows, then rank 1's,
    ...), from every rank's ``load_balanced_indices`` / ``thd_load_balanced_indices``."""
    return torch.cat(local_indices)


def split_for_context_parallel(
    x: torch.Tensor, seq_dim: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """This rank's share of a global tensor along ``seq_dim`` (Megatron's BSHD split).

    Args:
        x: any tensor with the global sequence on ``seq_dim`` (tokens, labels, positions,
            document ids, loss mask, activations).
        seq_dim: the sequence dimension.
        cp_size: N.
        cp_rank: r.

    Returns:
        ``x`` restricted to :func:`load_balanced_indices` along ``seq_dim`` (a copy).
    """
    if cp_size == 1:
        return x
    index = load_balanced_indices(x.shape[seq_dim], cp_size, cp_rank, device=x.device)
    return x.index_select(seq_dim, index)
