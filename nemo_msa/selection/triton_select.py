"""Fused MSA block selection for SM90 in Triton: index scorer + running top-k in registers.

One program owns ``BM`` query rows of one document block ``o`` and one index head. It streams
the document's key blocks ``0..o`` (block ``o`` causally masked), reduces q.k to the per-block
max and folds each block into a running top-k kept per row in registers. The score tensor
[heads, blocks, tokens] is never written: the only extra memory is the doc-block map, O(blocks).

Ranking key. Each candidate becomes one int64 so that "take the max" implements the whole
contract in one comparison::

    key = order(score) << 31 | (2**31 - 1 - block)

``order`` maps fp32 to an unsigned 32-bit code monotone in the float order; NaN gets code 1
(below -inf, so NaN ranks last); forced blocks get 0xFFFFFFF0 (above +inf; not all ones, which
would make block 0 collide with the unused-slot sentinel INT64_MAX). The low bits make
ties go to the lower block id. Empty slots are -1, so any candidate displaces them.

NaN. The reference's ``amax`` propagates NaN, while ``tl.max`` drops it (it lowers to the
IEEE maxNum, ``max.f32``). The block max is therefore a reduction whose combine keeps NaN
(``max.NaN.f32``, the same instruction cost), so a block scores NaN exactly when one of its
visible q.k does, as in the reference, +-inf inputs included, and it costs no extra pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nemo_msa.backends.capabilities import TRITON
from nemo_msa.triton.kernel_layout import (
    INTERPRET,
    check_kernel_devices,
    kernel_layout,
    query_subset,
)
from nemo_msa.triton.launch import SelectLaunch, current_launch
from nemo_msa.triton.tiles import (
    doc_block,
    max_keep_nan,
    next_pow2,
    row_descriptor,
    row_max_keep_nan,
    subset_rows,
    subset_tile,
)

_FORCED_CODE = tl.constexpr(0xFFFFFFF0)
_NAN_CODE = tl.constexpr(1)
_LOW_MASK = tl.constexpr(0x7FFFFFFF)

@triton.jit
def _order_code(score):
    """fp32 [R] -> int64 [R] code monotone in the float order (NaN handled by the caller)."""
    ones32 = tl.full((1,), 0xFFFFFFFF, tl.int64)
    top = tl.full((1,), 0x80000000, tl.int64)
    bits = score.to(tl.int32, bitcast=True).to(tl.int64) & ones32
    return tl.where(bits >= top, ones32 - bits, bits | top)


@triton.jit
def _insert(cur, thr, cols, new_key, KP: tl.constexpr, BRANCH: tl.constexpr):
    """Inserts new_key [R] into the running top-k cur [R, KP] (keys are unique per row) where
    it beats the row's threshold ``thr`` [R] (the smallest key held); returns the new
    ``(cur, thr)``. With BRANCH, blocks that no row takes cost one [R] comparison and a
    program-wide reduction: a trained indexer's neighbouring queries agree, so past the first
    blocks most blocks enter no row's top-k. Without it every block runs the update (no
    program-wide reduction; rows that do not take the block keep their slots)."""
    take = new_key > thr
    if BRANCH:
        if tl.max(take.to(tl.int32), axis=0) > 0:
            cur, thr = _replace_smallest(cur, thr, cols, new_key, take, KP)
    else:
        cur, thr = _replace_smallest(cur, thr, cols, new_key, take, KP)
    return cur, thr


@triton.jit
def _replace_smallest(cur, thr, cols, new_key, take, KP: tl.constexpr):
    """In the rows ``take``, new_key replaces the smallest key held (the threshold); returns
    ``(cur, thr)``."""
    first = tl.min(tl.where(cur == thr[:, None], cols[None, :], KP), axis=1)
    hit = (cols[None, :] == first[:, None]) & take[:, None]
    cur = tl.where(hit, new_key[:, None], cur)
    return cur, tl.min(cur, axis=1)


@triton.jit
def _select_kernel(
    q_ptr, k_ptr, k_desc, out_ptr,
    cu_ptr, block_doc_ptr, block_local_ptr,
    stride_qt, stride_qh, stride_kt, stride_oh, stride_ot,
    num_blocks_bound, top_k, init_blocks, local_blocks, tiles_ptr, qrow_ptr, num_tiles,
    BS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    KP: tl.constexpr, FP32_DOT: tl.constexpr, TMA: tl.constexpr, SUBSET: tl.constexpr,
):
    """Only the ids are kept: the sparse indexer loss finds the selected blocks' scores and
    argmax keys in its own pass over them (ADR 0033), which costs less than carrying them
    here. With SUBSET (ADR 0021) the programs run the ``num_tiles`` entries of the tile list
    ``tiles`` and the rows are the tiles' local queries, read and written at their local rows
    (``query_row``)."""
    SPLIT: tl.constexpr = BS // BM
    pid = tl.program_id(0)
    h = tl.program_id(1)
    # Reverse order: the last blocks of a document have the most candidates; start them first.
    if SUBSET:
        tile = subset_tile(num_tiles - 1 - pid, tiles_ptr, SUBSET)
    else:
        tile = num_blocks_bound * SPLIT - 1 - pid
    blk = tile // SPLIT
    sub = tile % SPLIT
    doc, o, start, length = doc_block(blk, block_doc_ptr, block_local_ptr, cu_ptr)
    if doc < 0:
        return

    rows = tl.arange(0, BM)
    pos = o * BS + sub * BM + rows
    row_ok = pos < length
    qrow, row_ok = subset_rows(start + pos, row_ok, qrow_ptr, SUBSET)
    dk = tl.arange(0, D)
    q = tl.load(q_ptr + qrow[:, None] * stride_qt + h * stride_qh
                + dk[None, :], mask=row_ok[:, None], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    cols = tl.arange(0, KP)
    empty = tl.full((BM, KP), -1, tl.int64)
    unused = tl.full((BM, KP), 0x7FFFFFFFFFFFFFFF, tl.int64)
    cur = tl.where(cols[None, :] < top_k, empty, unused)
    thr = tl.min(cur, axis=1)
    kn = tl.arange(0, BN)
    nan_code = tl.full((BM,), _NAN_CODE, tl.int64)
    forced_code = tl.full((BM,), _FORCED_CODE, tl.int64)
    zero_row = tl.zeros((BM,), tl.int64)

    # Full blocks 0..o-1: every key visible to every row of the tile, no mask.
    for b in range(0, o):
        best = tl.full((BM,), float("-inf"), tl.float32)
        for c in tl.static_range(0, BS, BN):
            krow = start + b * BS + c + kn
            if TMA:
                k = k_desc.load([start + b * BS + c, 0])
            else:
                k = tl.load(k_ptr + krow[:, None].to(tl.int64) * stride_kt + dk[None, :])
            if FP32_DOT:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k))
            best = max_keep_nan(best, row_max_keep_nan(s))
        code = tl.where(best != best, nan_code, _order_code(best))
        forced = (b < init_blocks) | (b > o - local_blocks)
        code = tl.where(forced, forced_code, code)
        new_key = (code << 31) | (zero_row + (_LOW_MASK - b))
        cur, thr = _insert(cur, thr, cols, new_key, KP, False)

    # Own block o: keys j <= pos only.
    best = tl.full((BM,), float("-inf"), tl.float32)
    for c in tl.static_range(0, BS, BN):
        j = o * BS + c + kn
        kmask = j < length
        k = tl.load(k_ptr + (start + j)[:, None].to(tl.int64) * stride_kt + dk[None, :],
                    mask=kmask[:, None], other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k))
        vis = j[None, :] <= pos[:, None]
        best = max_keep_nan(best, row_max_keep_nan(tl.where(vis, s, float("-inf"))))
    code = tl.where(best != best, nan_code, _order_code(best))
    forced = (o < init_blocks) | (local_blocks > 0)
    code = tl.where(forced, forced_code, code)
    new_key = (code << 31) | (zero_row + (_LOW_MASK - o))
    cur, thr = _insert(cur, thr, cols, new_key, KP, True)

    # Canonical output: ascending block ids, -1 tail.
    big = 0x7FFFFFFF
    valid = (cur >= 0) & (cur != unused)
    low = tl.full((BM, KP), _LOW_MASK, tl.int64)
    row_off = h * stride_oh + qrow[:, None] * stride_ot + cols[None, :]
    store_mask = row_ok[:, None] & (cols[None, :] < top_k)
    ids = tl.where(valid, (low - (cur & low)).to(tl.int32), big)
    ids = tl.sort(ids, dim=1)
    ids = tl.where(ids == big, -1, ids)
    tl.store(out_ptr + row_off, ids, mask=store_mask)


def triton_select_blocks(index_q: torch.Tensor, index_k: torch.Tensor, msa, *, top_k: int,
                         init_blocks: int, local_blocks: int, score: str = "max",
                         block_size: int | None = None, launch: SelectLaunch | None = None,
                         queries: torch.Tensor | None = None):
    """Selects ``top_k`` key blocks per (index head, query token) with one fused kernel.

    Args:
        index_q: bf16 or fp16 [T, H, d] index queries (d in {16, 32, 64, 128}).
        index_k: same dtype [T, d]; the single shared index key head.
        msa: the microbatch layout (``MSAMicrobatch``); its ``block_size`` is used unless
            ``block_size`` is given.
        top_k: blocks per query, 1..32.
        init_blocks: number of forced sink blocks at the document start (>= 0).
        local_blocks: number of forced blocks ending at the query's own block (>= 0).
        score: block score; only ``"max"`` is implemented.
        block_size: key block size in tokens (16, 32, 64 or 128); defaults to
            ``msa.block_size``.
        launch: launch parameters; None takes
            :func:`~nemo_msa.triton.launch.current_launch` ``("sel")``.
        queries: int64 [Tq] global compact rows of the local queries (context parallelism:
            ascending, unique), or None for every token. With it index_q and every output
            have Tq rows, index_k the layout's T rows (the keys are global compact rows); each
            row equals the full launch's row of its token (ADR 0021).

    Returns:
        int32 [H, T, top_k]: document-local block ids ascending, -1 at the tail.

    Raises:
        ValueError: on a bad argument; the message names it, its value and the expectation.
    """
    cfg = current_launch("sel") if launch is None else launch
    bs = int(block_size if block_size is not None else msa.block_size)
    if index_q.dim() != 3:
        raise ValueError(f"index_q must be [T, H, d], got shape {tuple(index_q.shape)}")
    t, h, d = index_q.shape
    tk = msa.num_tokens if queries is not None else t
    if index_k.shape != (tk, d):
        raise ValueError(f"index_k must be [T={tk}, d={d}] like index_q, got "
                         f"{tuple(index_k.shape)}")
    if index_k.dtype != index_q.dtype:
        raise ValueError(f"index_q/index_k must share a dtype, got {index_q.dtype} and "
                         f"{index_k.dtype}")
    reason = TRITON.why_not(score_type=score, dtype=index_q.dtype, index_head_dim=d,
                            block_size=bs, top_k=top_k)
    if reason is not None:
        raise ValueError(f"the Triton selection cannot run {reason}")
    if init_blocks < 0 or local_blocks < 0 or init_blocks + local_blocks > top_k:
        raise ValueError(f"init_blocks={init_blocks}, local_blocks={local_blocks}: expected "
                         f"non-negative with a sum <= top_k={top_k}")
    view = kernel_layout(msa, bs)
    subset = query_subset(msa, bs, queries)
    if subset is not None and t != subset.num_queries:
        raise ValueError(f"index_q has {t} rows but queries holds {subset.num_queries} tokens")
    if subset is None and t != view.num_tokens:
        raise ValueError(f"index_q has T={t} tokens but msa.num_tokens={view.num_tokens}")
    check_kernel_devices(view, index_q=index_q, index_k=index_k)
    out = torch.empty((h, t, top_k), dtype=torch.int32, device=index_q.device)
    if t == 0:
        return out
    q = index_q.contiguous()
    k = index_k.contiguous()
    bm = min(bs, cfg.bm)
    bn = min(bs, cfg.bn) if d == 128 else bs
    k_desc = row_descriptor(k, bn, d, INTERPRET) if cfg.tma else None
    tiles = subset.tile_list(bm) if subset is not None else view.cu_seqlens
    num_tiles = tiles.numel() if subset is not None else view.num_blocks_bound * (bs // bm)
    _select_kernel[(num_tiles, h)](
        q_ptr=q, k_ptr=k, k_desc=k if k_desc is None else k_desc, out_ptr=out,
        cu_ptr=view.cu_seqlens, block_doc_ptr=view.block_doc,
        block_local_ptr=view.block_local, stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_kt=k.stride(0), stride_oh=out.stride(0), stride_ot=out.stride(1),
        num_blocks_bound=view.num_blocks_bound, top_k=top_k, init_blocks=init_blocks,
        local_blocks=local_blocks, tiles_ptr=tiles,
        qrow_ptr=view.cu_seqlens if subset is None else subset.query_row, num_tiles=num_tiles,
        BS=bs, BM=bm, BN=bn, D=d, KP=max(next_pow2(top_k), 2),
        FP32_DOT=INTERPRET, TMA=k_desc is not None, SUBSET=subset is not None,
        num_warps=cfg.num_warps if bm * bn >= 64 * 64 else 4, num_stages=cfg.num_stages,
    )
    return out
