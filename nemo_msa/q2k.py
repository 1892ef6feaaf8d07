"""One meaning for every q2k, its canonical form, and a selection that knows it holds it.

MSA_SPEC.md: any int32 q2k [Hkv, T, top_k] means, per (KV head, token), the *set* of its entries
that are document-local block ids in ``0..own block``; order, duplicates, -1 and other ids change
nothing. :func:`canonical_q2k` computes that set's canonical form (ascending, -1 at the tail),
which is what :func:`nemo_msa.select_blocks` returns and what the kernels assume.

A :class:`Selection` carries a q2k with what is known about it: the block size its ids count in,
whether it is canonical (``select_blocks``'s output is, so the ops pay nothing for the canonical
q2k of training; a bare q2k is brought to the canonical form once, two sorts of
[Hkv, T, top_k], before any kernel reads it), and the kernels' state of it that the backward
reuses (the Triton forward's union lists). The layer and the ops pass the object, so nothing is
looked up by tensor identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nemo_msa.layout import MSAMicrobatch, query_rows

__all__ = ["Selection", "canonical_q2k"]


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
        int32 [Hkv, T, top_k], equal to ``select_blocks``'s output for the same sets.
    """
    positions = query_rows(msa.document_positions, queries)
    own = (positions.long() // msa.block_size)[None, :, None]  # [1, T, 1]
    ids = q2k.long()
    unused = torch.iinfo(torch.int64).max
    ids = torch.where((ids >= 0) & (ids <= own), ids, unused).sort(dim=-1).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.where(repeat, unused, ids).sort(dim=-1).values
    return torch.where(ids == unused, -1, ids).to(torch.int32)


@dataclass(eq=False)
class Selection:
    """Selected key blocks with what is known about them: what the layer and the ops pass.

    Attributes:
        q2k: int32 [Hkv, Tq, top_k] document-local block ids (Tq: the view's queries).
        block_size: the key-block size its ids count in (the layout's it was selected on).
        canonical: ``q2k`` holds the canonical form (``select_blocks``'s, or
            :func:`canonical_q2k`'s): ascending ids in 0..own block, -1 at the tail.
        unions: the Triton forward's union lists of this selection
            (:class:`~nemo_msa.attention.triton_union.TileUnions`), kept for its backward's dq;
            None until a forward builds them (and for the other backends).
    """

    q2k: torch.Tensor
    block_size: int
    canonical: bool = False
    unions: object | None = None
    _version: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._version = self.q2k._version

    def check_intact(self) -> None:
        """Raises where ``q2k`` was written in place since the selection was made: what it
        claims about it (canonical, its union lists) no longer holds.

        Raises:
            ValueError: naming the write.
        """
        if self.q2k._version != self._version:
            raise ValueError(
                "the selection's q2k was written in place after it was made (its canonical "
                "form and union lists no longer hold); select again, or pass the changed "
                "tensor itself, which the op brings to the canonical form"
            )
