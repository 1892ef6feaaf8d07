"""One meaning for every q2k: its canonical form, and which tensors are known to hold it.

MSA_SPEC.md: any int32 q2k [Hkv, T, top_k] means, per (KV head, token), the *set* of its entries
that are document-local block ids in ``0..own block``; order, duplicates, -1 and other ids change
nothing. :func:`canonical_q2k` computes that set's canonical form (ascending, -1 at the tail),
which is what :func:`nemo_msa.select_blocks` returns and what the kernels assume.

``select_blocks`` marks its outputs (:func:`mark_canonical`), so the ops pay nothing for the
canonical q2k of training; a q2k made or changed by hand is brought to the canonical form once
(two sorts of [Hkv, T, top_k]) before any kernel reads it. The mark is a weak map from the tensor
to its ``_version`` (an in-place write unmarks it), like the layout's memo: keyed by ``id`` with
a weak reference, since tensors compare elementwise (a ``WeakKeyDictionary`` would call that).
"""

from __future__ import annotations

import weakref

import torch

from nemo_msa.layout import MSAMicrobatch, query_rows

__all__ = ["canonical_q2k", "is_marked_canonical", "mark_canonical", "marked_block_size"]

# id(tensor) -> (weak reference to it, its _version when it was marked, its block size).
_CANONICAL: dict[int, tuple[weakref.ref, int, int]] = {}


def canonical_q2k(
    q2k: torch.Tensor, msa: MSAMicrobatch, queries: torch.Tensor | None = None
) -> torch.Tensor:
    """The canonical form of any q2k: per (KV head, token) the set of its entries that are
    document-local block ids in ``0..own block``, ascending, padded with -1 at the tail.

    Duplicates count once; -1, negative ids and ids past the token's own block (including ids
    past the workspace) are dropped; order does not matter. Two sorts of [Hkv, T, top_k], no
    host synchronization.

    Args:
        q2k: int [Hkv, T, top_k] ([Hkv, Tq, top_k] with ``queries``).
        msa: the layout (``document_positions`` [T], ``block_size``).
        queries: optional int64 [Tq] global compact rows of q2k's tokens (a query subset).

    Returns:
        int32 [Hkv, T, top_k], equal to ``select_blocks``'s output for the same sets (marked
        canonical).
    """
    positions = query_rows(msa.document_positions, queries)
    own = (positions.long() // msa.block_size)[None, :, None]  # [1, T, 1]
    ids = q2k.long()
    unused = torch.iinfo(torch.int64).max
    ids = torch.where((ids >= 0) & (ids <= own), ids, unused).sort(dim=-1).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.where(repeat, unused, ids).sort(dim=-1).values
    return mark_canonical(torch.where(ids == unused, -1, ids).to(torch.int32), msa.block_size)


def mark_canonical(q2k: torch.Tensor, block_size: int) -> torch.Tensor:
    """Records that ``q2k`` holds the canonical form of block ids of ``block_size`` tokens
    (until it is written in place); returns it."""
    key = id(q2k)

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _CANONICAL.get(key, (None,))[0] is ref:
            del _CANONICAL[key]

    _CANONICAL[key] = (weakref.ref(q2k, forget), q2k._version, int(block_size))
    return q2k


def is_marked_canonical(q2k: torch.Tensor) -> bool:
    """Whether ``q2k`` was marked canonical and has not been written in place since."""
    return marked_block_size(q2k) is not None


def marked_block_size(q2k: torch.Tensor) -> int | None:
    """The block size ``q2k``'s ids were made for, where it was marked canonical and has not
    been written in place since; else None."""
    ref, version, block_size = _CANONICAL.get(id(q2k), (None, -1, 0))
    if ref is None or ref() is not q2k or version != q2k._version:
        return None
    return block_size
