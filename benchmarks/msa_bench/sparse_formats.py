"""An MSA selection in the formats of the block-sparse attention peers (issue #60, ADR 0056).

Pure torch on any device, so that every conversion is tested on the CPU by expanding the peer's
format back to a dense boolean mask and comparing it with MSA's (each token attends only the keys
of its own selected blocks, causally, within its document).

- FlashAttention-4 (``flash-attn-4`` 4.0.0b40, CuTe DSL, ``flash_attn.cute.flash_attn_func``) on
  SM90 takes, per (batch, query head, 128-query tile), two ascending lists of 128-key blocks
  (``BlockSparseTensorsTorch``: ``mask_block_cnt/idx`` are blocks whose elements pass through
  ``mask_mod``, ``full_block_cnt/idx`` blocks it computes unmasked), and for the backward the
  transposed lists (per 128-key block, the 128-query tiles; ``block_sparse_tensors_bwd``). The
  union of a tile's tokens' selections per KV head gives the lists (:func:`tile_block_lists`);
  a block every token of the tile selected and that lies wholly before the tile is full, every
  other union block is a mask block, and a per-token membership bitmask read by ``mask_mod``
  (:func:`membership_bits`, :func:`mask_mod_reference`) keeps the function MSA's. Per-head lists
  are refused with ``pack_gqa`` (FA4's ``validate_fwd_config``: "PackGQA requires head-broadcast
  sparse masks"), so they are repeated over each KV head's query heads.
- The same lists without ``mask_mod``, every union block full except those a tile token cannot
  wholly see (computed with ``causal=True``), make FA4 compute attention over the whole union
  (:func:`union_bound_lists`): another function, a bound on what a union-blocks kernel without
  per-token masks costs, never a backend.
- cuDNN-FE 1.32's ``cudnn.flex_attention`` takes an interval mask ``mask_func`` int32 [Hmask,
  nfunc, T] (Hmask 1 or Hq, nfunc odd): query t sees keys ``[0, F0) U [F1, F2) U ...``, the
  endpoints non-decreasing within [0, k_len] (its plan kernels mark anything else invalid). One
  interval per selected block, clipped causally, gives MSA exactly (:func:`interval_mask`).

Shapes: ``q2k`` int [Hkv, T, top_k] of one document (document-local block ids = key blocks), any
order, -1 / ids past the own block / duplicates ignored (:func:`nemo_msa.q2k.canonical_q2k`).
"""

from __future__ import annotations

import torch

from nemo_msa.q2k import canonical_q2k


def one_document_tokens(msa) -> int:
    """The token count of a layout that holds exactly one document (the peers' fixed-length
    path); raises ValueError naming the document lengths otherwise."""
    lengths = [int(n) for n in msa.document_lengths]
    if len(lengths) != 1:
        raise ValueError(f"document lengths {lengths}: the block-sparse peers' conversions take "
                         f"one document per layout")
    return lengths[0]


def tile_block_counts(q2k: torch.Tensor, msa, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How many tokens of each ``tile``-token query tile selected each key block.

    Args:
        q2k: int [Hkv, T, top_k] the selection of one document.
        msa: its layout (one document).
        tile: query tokens per tile.

    Returns:
        ``(counts, rows)``: int32 [Hkv, M, NB] tokens of tile m that selected block b on KV head
        g (M = ceil(T / tile) tiles, NB = ceil(T / block) blocks), and int64 [M] tokens per tile.
    """
    t = one_document_tokens(msa)
    ids = canonical_q2k(q2k, msa).long()
    heads = ids.shape[0]
    nb = -(-t // msa.block_size)
    m = -(-t // tile)
    tile_of = torch.arange(t, device=ids.device) // tile
    # Slot -1 lands in a spare column NB that is cut off below.
    column = torch.where(ids >= 0, ids, nb)
    flat = (tile_of[None, :, None] * (nb + 1) + column).reshape(heads, -1)
    counts = torch.zeros((heads, m * (nb + 1)), dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.int32))
    rows = torch.bincount(tile_of, minlength=m)
    return counts.view(heads, m, nb + 1)[..., :nb], rows


def _wholly_visible(m: int, nb: int, tile: int, block: int, device) -> torch.Tensor:
    """bool [M, NB]: block b ends at or before tile m's first token (every token sees it all)."""
    first = torch.arange(m, device=device)[:, None] * tile
    return (torch.arange(nb, device=device)[None, :] + 1) * block <= first


def pack_lists(present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending index lists of a boolean table, packed left.

    Args:
        present: bool [..., N].

    Returns:
        ``(count, index)``: int32 [...] entries per row, int32 [..., W] their indices in
        ascending order, packed left, 0 past the count (W = the largest count, at least 1).
    """
    n = present.shape[-1]
    order = torch.arange(n, device=present.device)
    keys = torch.where(present, order, n).sort(dim=-1).values
    count = present.sum(-1, dtype=torch.int32)
    width = max(int(count.max()) if count.numel() else 0, 1)
    index = keys[..., :width]
    return count, torch.where(index < n, index, 0).to(torch.int32)


def tile_block_lists(q2k: torch.Tensor, msa, tile: int) -> dict:
    """The union of each tile's selections, split into full and mask blocks.

    Args:
        q2k: int [Hkv, T, top_k] the selection of one document.
        msa: its layout (one document).
        tile: query tokens per tile (FA4 on SM90: 128, the MSA block).

    Returns:
        ``{"union", "full", "mask"}``: bool [Hkv, M, NB]; ``full`` = every token of the tile
        selected the block and the block lies wholly before the tile, ``mask`` = the rest of
        the union; and ``"rows"`` int64 [M] tokens per tile.
    """
    counts, rows = tile_block_counts(q2k, msa, tile)
    _, m, nb = counts.shape
    union = counts > 0
    whole = _wholly_visible(m, nb, tile, msa.block_size, counts.device)
    full = (counts == rows[None, :, None].to(counts.dtype)) & whole[None]
    return {"union": union, "full": full, "mask": union & ~full, "rows": rows}


def union_bound_lists(lists: dict, tile: int, block: int) -> dict:
    """The union as FA4 computes it without ``mask_mod`` and with ``causal=True``: blocks wholly
    before the tile full, the others (the tile's own) masked causally. Attention over every key
    of the union: another function than MSA's (a rate bound only).

    Args:
        lists: :func:`tile_block_lists`'s output.
        tile, block: query tokens per tile, keys per block.

    Returns:
        ``{"union", "full", "mask", "rows"}`` as :func:`tile_block_lists`.
    """
    union = lists["union"]
    _, m, nb = union.shape
    whole = _wholly_visible(m, nb, tile, block, union.device)[None]
    return {"union": union, "full": union & whole, "mask": union & ~whole, "rows": lists["rows"]}


def fa4_block_sparse(lists: dict, group: int) -> dict:
    """FA4's forward and backward block-sparse tensors of :func:`tile_block_lists` (or
    :func:`union_bound_lists`) for ``group`` query heads per KV head.

    Returns:
        ``{"fwd": (mask_cnt, mask_idx, full_cnt, full_idx), "bwd": (...)}``: int32, forward
        [1, Hq, M] / [1, Hq, M, W] (per query tile its key blocks), backward [1, Hq, NB] /
        [1, Hq, NB, W'] (per key block its query tiles), ascending, packed left, query head h
        reading KV head h // group.
    """
    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(group, dim=0).unsqueeze(0).contiguous()

    out = {}
    for name, transpose in (("fwd", False), ("bwd", True)):
        tensors = []
        for kind in ("mask", "full"):
            table = lists[kind].transpose(1, 2) if transpose else lists[kind]
            count, index = pack_lists(table)
            tensors += [heads(count), heads(index)]
        out[name] = tuple(tensors)
    return out


def membership_bits(q2k: torch.Tensor, msa) -> torch.Tensor:
    """Each token's selected blocks as a bitmask, the ``mask_mod``'s auxiliary tensor.

    Args:
        q2k: int [Hkv, T, top_k] the selection of one document.
        msa: its layout (one document).

    Returns:
        int32 [Hkv, T, ceil(NB / 32)]: bit ``b % 32`` of word ``b // 32`` is set where the token
        selected block b (stored as int32: bit 31 makes the word negative).
    """
    t = one_document_tokens(msa)
    ids = canonical_q2k(q2k, msa).long()
    blocks = -(-t // msa.block_size)
    words = -(-blocks // 32)
    valid = ids >= 0
    safe = torch.where(valid, ids, 0)
    # Canonical ids are distinct per token, so adding the bits is or-ing them.
    value = torch.where(valid, torch.ones_like(safe) << (safe & 31), 0)
    bits = torch.zeros((ids.shape[0], t, words), dtype=torch.int64, device=ids.device)
    bits.scatter_add_(2, safe >> 5, value)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def mask_mod_reference(bits: torch.Tensor, group: int, block: int, head: int,
                       q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """The arithmetic of the FA4 ``mask_mod`` (``msa_bench.sparse_peers.fa4_mask_mod``) in
    torch int32, element for element: bit ``kv_idx >> log2(block)`` of query ``q_idx``'s words on
    KV head ``head // group``, and ``kv_idx <= q_idx``.

    Args:
        bits: :func:`membership_bits`'s output.
        group, block: query heads per KV head; keys per block (a power of two).
        head: the query head.
        q_idx, kv_idx: int32 broadcastable query and key indices.

    Returns:
        bool, the broadcast shape of ``q_idx`` and ``kv_idx``.
    """
    shift = block.bit_length() - 1
    q_idx, kv_idx = torch.broadcast_tensors(q_idx.to(torch.int32), kv_idx.to(torch.int32))
    blk = kv_idx >> shift
    word = bits[head // group][q_idx.long(), (blk >> 5).long()]
    selected = (word >> (blk & 31)) & 1
    return (selected == 1) & (kv_idx <= q_idx)


def fa4_dense_mask(tensors: tuple, t: int, tile: int, block: int, element_mask) -> torch.Tensor:
    """What FA4 attends, from its forward lists: the full blocks wholly, the mask blocks where
    ``element_mask(head, q_idx, kv_idx)`` holds (the ``mask_mod``, or causality).

    Args:
        tensors: ``(mask_cnt, mask_idx, full_cnt, full_idx)`` of :func:`fa4_block_sparse`.
        t: tokens (queries = keys).
        tile, block: query tokens per tile, keys per block.
        element_mask: ``(head, q_idx [r, 1], kv_idx [1, c]) -> bool [r, c]``.

    Returns:
        bool [Hq, T, T].

    Raises:
        ValueError: a block listed twice for one tile (in one list or both).
    """
    mask_cnt, mask_idx, full_cnt, full_idx = (x[0].cpu() for x in tensors)
    hq, m = mask_cnt.shape
    seen = torch.zeros((hq, t, t), dtype=torch.bool)
    for h in range(hq):
        for i in range(m):
            rows = torch.arange(i * tile, min((i + 1) * tile, t))
            listed = [int(b) for b in full_idx[h, i, :full_cnt[h, i]]]
            listed += [int(b) for b in mask_idx[h, i, :mask_cnt[h, i]]]
            if len(set(listed)) != len(listed):
                raise ValueError(f"head {h}, tile {i}: blocks {listed} listed twice")
            for j, b in enumerate(listed):
                cols = torch.arange(b * block, min((b + 1) * block, t))
                keep = (torch.ones((rows.numel(), cols.numel()), dtype=torch.bool)
                        if j < int(full_cnt[h, i])
                        else element_mask(h, rows[:, None], cols[None, :]))
                seen[h, rows[:, None], cols[None, :]] = keep
    return seen


def transposed_pairs(tensors: tuple) -> set:
    """``{(head, tile, block, kind)}`` of backward lists (per block its tiles), to compare with
    the forward lists' (per tile its blocks) of :func:`list_pairs`."""
    mask_cnt, mask_idx, full_cnt, full_idx = (x[0].cpu() for x in tensors)
    out = set()
    for kind, cnt, idx in (("mask", mask_cnt, mask_idx), ("full", full_cnt, full_idx)):
        for h, n in zip(*torch.nonzero(cnt >= 0, as_tuple=True), strict=True):
            for i in idx[h, n, :cnt[h, n]].tolist():
                out.add((int(h), i, int(n), kind))
    return out


def list_pairs(tensors: tuple) -> set:
    """``{(head, tile, block, kind)}`` of forward lists (per tile its blocks)."""
    mask_cnt, mask_idx, full_cnt, full_idx = (x[0].cpu() for x in tensors)
    out = set()
    for kind, cnt, idx in (("mask", mask_cnt, mask_idx), ("full", full_cnt, full_idx)):
        for h, i in zip(*torch.nonzero(cnt >= 0, as_tuple=True), strict=True):
            for b in idx[h, i, :cnt[h, i]].tolist():
                out.add((int(h), int(i), b, kind))
    return out


def union_pairs(lists: dict, t: int, tile: int, block: int) -> dict:
    """(query, key) pairs per query head (mean over KV heads) of the union blocks.

    Returns:
        ``{"computed": every (row, key) of each tile x union block, what a union-blocks kernel
        multiplies, "causal": those with key <= query, what :func:`union_bound_lists` attends}``.
    """
    union = lists["union"]
    heads, m, nb = union.shape
    per_tile = union.sum(0).double()  # [M, NB]: KV heads whose union holds the block
    starts = torch.arange(nb, device=union.device) * block
    cols = torch.clamp(t - starts, max=block)
    computed = (per_tile * lists["rows"].double()[:, None] * cols.double()).sum()
    # A token p sees min(block, p - b * block + 1) keys of block b (none past it): summed over
    # each tile's tokens, one row offset at a time (no [T, NB] temporary).
    visible = torch.zeros((m, nb), dtype=torch.float64, device=union.device)
    for r in range(tile):
        p = torch.arange(m, device=union.device) * tile + r
        keys = (p[:, None] - starts[None, :] + 1).clamp(0, block).double()
        visible += torch.where((p < t)[:, None], keys, 0.0)
    causal = (per_tile * visible).sum()
    return {"computed": computed.item() / heads, "causal": causal.item() / heads}


def interval_mask(q2k: torch.Tensor, msa) -> torch.Tensor:
    """cuDNN-FE flex attention's interval mask of an MSA selection: query t of KV head g sees
    ``[0, F0) U [F1, F2) U ...`` with ``F0 = 0`` and one interval ``[b * block, min((b + 1) *
    block, t + 1))`` per selected block b, ascending; unused slots are empty intervals at the
    last end (the endpoints stay non-decreasing, as the plan kernels require).

    Args:
        q2k: int [Hkv, T, top_k] the selection of one document.
        msa: its layout (one document).

    Returns:
        int32 [Hkv, 2 * top_k + 1, T] (``mask_func[g : g + 1]`` is KV head g's, Hmask = 1).
    """
    one_document_tokens(msa)
    ids = canonical_q2k(q2k, msa).long()
    block = msa.block_size
    pos = msa.document_positions.long()[None, :, None]
    begin = ids * block
    end = torch.minimum((ids + 1) * block, pos + 1)
    valid = ids >= 0
    # Canonical slots are valid first: an unused slot repeats the last valid end (empty).
    last_end = torch.where(valid, end, 0).amax(-1, keepdim=True)
    begin = torch.where(valid, begin, last_end)
    end = torch.where(valid, end, last_end)
    heads, t, k = ids.shape
    func = torch.zeros((heads, 2 * k + 1, t), dtype=torch.int32, device=ids.device)
    func[:, 1::2] = begin.permute(0, 2, 1).to(torch.int32)
    func[:, 2::2] = end.permute(0, 2, 1).to(torch.int32)
    return func


def check_intervals(func: torch.Tensor, k_len: int) -> None:
    """The plan kernels' validity rule for ``mask_func`` (cudnn ``q2k_classify.py``: an endpoint
    below 0 or past ``k_len``, an interval ending before it begins, or one beginning before the
    last one ended marks the mask invalid).

    Raises:
        ValueError: naming the first (head, query, interval) that breaks it.
    """
    heads, nfunc, t = func.shape
    if nfunc % 2 == 0:
        raise ValueError(f"nfunc={nfunc}: expected an odd count of endpoints")
    f = func.long()
    begin = torch.cat([torch.zeros_like(f[:, :1]), f[:, 1::2]], 1)  # [H, I, T]
    end = f[:, 0::2]
    previous = torch.cat([torch.zeros_like(end[:, :1]), end[:, :-1]], 1)
    bad = (begin < 0) | (end < begin) | (end > k_len) | (begin < previous)
    if bool(bad.any()):
        h, i, q = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(f"mask_func head {h}, query {q}, interval {i}: [{int(begin[h, i, q])}, "
                         f"{int(end[h, i, q])}) after an interval ending at "
                         f"{int(previous[h, i, q])}, keys 0..{k_len}: not a valid interval mask")


def interval_dense_mask(func: torch.Tensor, k_len: int) -> torch.Tensor:
    """bool [Hmask, T, k_len]: the keys an interval mask makes visible, by its documented
    semantics (``[0, F0) U [F1, F2) U ...``)."""
    f = func.long()
    begin = torch.cat([torch.zeros_like(f[:, :1]), f[:, 1::2]], 1)  # [H, I, T]
    end = f[:, 0::2]
    keys = torch.arange(k_len, device=func.device)[None, None, None, :]
    inside = (keys >= begin[..., None]) & (keys < end[..., None])  # [H, I, T, K]
    return inside.any(1)
