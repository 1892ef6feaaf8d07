"""How coherent a selection is, in the terms of the Triton kernels' hybrid schedule (ADR 0003).

The union kernels run a tile of ``qt`` consecutive tokens of one document block over the union
of the blocks the tile's tokens selected; every row of the tile pays for every union block, so a
tile costs ``union * tokens`` block-rows where the exact work is the tokens' own selected blocks.
Tiles whose union exceeds the cap (``union_max``) run the per-token kernels instead, at the exact
work but a lower rate. These helpers measure that trade on a given selection, without a GPU.
"""

from __future__ import annotations

import torch


def tile_union_sizes(q2k: torch.Tensor, documents: torch.Tensor, positions: torch.Tensor,
                     qt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Union size, token count and exact work of every ``qt``-token tile.

    Args:
        q2k: int [H, T, top_k] document-local block ids per (KV head, token), -1 = none.
        documents: int [T] document index of each compact token.
        positions: int [T] position of each token in its document.
        qt: tokens per tile (a tile never spans two documents; it starts at a multiple of
            ``qt`` in its document).

    Returns:
        ``(union, tokens, exact)``: int64 [H, N] distinct selected blocks per tile, int64 [N]
        tokens per tile, int64 [H, N] selected (token, block) pairs per tile; N tiles in the
        order of their first token.

    Raises:
        ValueError: for ``qt`` < 1 or tensors whose token counts disagree.
    """
    if qt < 1:
        raise ValueError(f"qt={qt}: expected >= 1")
    heads, t, _ = q2k.shape
    if documents.shape != (t,) or positions.shape != (t,):
        raise ValueError(f"documents {tuple(documents.shape)} / positions "
                         f"{tuple(positions.shape)}: expected [{t}] like q2k's tokens")
    q2k = q2k.long()
    documents, positions = documents.long(), positions.long()
    # A tile is (document, position // qt); compact order keeps each tile's tokens together.
    starts = torch.ones(t, dtype=torch.bool)
    starts[1:] = (documents[1:] != documents[:-1]) | (positions[1:] // qt
                                                     != positions[:-1] // qt)
    tile = torch.cumsum(starts.long(), 0) - 1
    n = int(tile[-1]) + 1 if t else 0
    tokens = torch.bincount(tile, minlength=n)
    valid = q2k >= 0
    exact = torch.zeros((heads, n), dtype=torch.long).index_add_(1, tile, valid.sum(-1))
    width = int(q2k.max()) + 1 if t and bool(valid.any()) else 1
    present = torch.zeros((heads, n, width), dtype=torch.bool)
    h_idx = torch.arange(heads)[:, None, None].expand_as(q2k)
    t_idx = tile[None, :, None].expand_as(q2k)
    present[h_idx[valid], t_idx[valid], q2k[valid]] = True
    return present.sum(-1), tokens, exact


def hybrid_work(union: torch.Tensor, tokens: torch.Tensor, exact: torch.Tensor,
                cap: int) -> dict:
    """The hybrid schedule's split at ``union_max = cap``.

    Args:
        union, tokens, exact: :func:`tile_union_sizes`'s outputs.
        cap: the largest union the union kernel takes.

    Returns:
        ``{"union_tiles": share of tiles on the union kernel, "union_exact_share": share of the
        exact work they hold, "union_inflation": their union work / their exact work}``.
    """
    on_union = union <= cap
    union_work = (union * tokens[None, :])[on_union].sum().item()
    union_exact = exact[on_union].sum().item()
    total = exact.sum().item()
    return {"union_tiles": on_union.float().mean().item(),
            "union_exact_share": union_exact / total if total else 0.0,
            "union_inflation": union_work / union_exact if union_exact else 0.0}
