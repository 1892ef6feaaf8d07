"""MSA sparse attention forward for SM90 in Triton: a per-tile hybrid of two query-outer kernels.

Per-token kernel. One program owns one query token and one KV head ``g``: the ``G = Hq / Hkv``
query heads of the group share the token's ``top_k`` selected blocks (q2k is per KV head), so
the program's tile is [G (padded to >= 16), d] and it streams the selected key blocks with an
online softmax. Every selected key is read once per (token, KV head); no union overhead, but
16 FLOP per K/V byte, which bounds it by memory traffic.

Union kernel. One program owns ``union_qt`` consecutive tokens of one document block (M =
union_qt * G rows) and walks the sorted union of their blocks; a row sees only blocks its own
token selected. Tiles whose union is small (coherent selections, as trained indexers give) run
here and share each K/V read; the others exit and are done by the per-token kernel. The split
is decided per tile on the device (no host sync). ADR 0003 has the measurements.

Masking. Key ``j`` (document-local) of block ``b`` is visible to the query at position ``p``
iff ``b >= 0`` and ``j <= p``; ``j <= p`` also keeps the reads inside the document, so q2k
entries that are -1 or point past the own block cost a masked tile and contribute nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nemo_msa.attention.triton_layout import INTERPRET, check_kernel_devices, doc_blocks
from nemo_msa.attention.triton_tiles import (
    LOG2E,
    finish_block_mass,
    finish_softmax,
    fold_block_mass,
    kv_descriptors,
    load_kv_tile,
    load_masked_union_tile,
    load_own_union_tile_tma,
    load_rows,
    load_selection_rows,
    load_whole_kv_tile,
    next_pow2,
    online_softmax_rows,
    online_softmax_step,
    register_cap,
    rows_selecting,
    tile_tokens_left,
    token_taken_by_union,
    union_flat_step,
    union_full_blocks,
    union_masked_end,
    union_tile_rows,
    union_tile_skipped,
    union_tile_span,
)

# Launch parameters for d = 128 (keys per inner tile, warps, pipeline depth); scripts/bench_msa.py
# sweeps them (ADR 0003). Smaller head dims use a whole block per tile.
# Hybrid schedule (d = 128, block >= 64): tiles of "union_qt" tokens whose selected blocks
# have a union of at most "union_max" blocks run the query-tile union kernel (M = 128 rows,
# K/V read once per tile); the others run the per-token kernel. Break-even measured at about
# 30 blocks for 8-token tiles (ADR 0003); with the two-programs-per-SM union kernel 40 was
# 0.2-0.3 ms faster than 30 in two calls (v10). union_qt = 0 disables the union kernel.
# union_split: the union kernel walks the whole blocks before a tile's own block without a
# per-score mask; union_tma: and reads them by TMA (Hopper; pointer loads elsewhere).
CONFIG = {"bn": 128, "num_warps": 4, "num_stages": 2,
          "union_qt": 8, "union_max": 40, "union_warps": 8,
          "union_bn": 64, "union_stages": 2, "union_split": True, "union_tma": True,
          # tile_grid: the per-token kernel of a hybrid launch gets one program per union tile
          # (its tokens one by one) instead of one per token (8x fewer programs that exit at
          # once; 0.6 ms faster at 131072 tokens, ADR 0003 v8).
          "tile_grid": True,
          # tile_grid_tiles: union tiles per program of that grid. With coherent selections
          # nearly every program only reads its tiles' counts and exits; 8 per program cut the
          # per-token kernel from 0.11 to 0.04 ms, but random selections (every tile left to
          # it) slowed from 72.2 to 75.5 ms (4: 74.6), so 1 (ADR 0003 v11).
          "tile_grid_tiles": 1,
          # union_build: the union lists of the hybrid split (forward and dq) built by torch
          # sorts in chunks ("torch") or by one Triton kernel ("triton_scan"), over
          # union_build_tiles tiles per program of union_build_warps warps.
          "union_build": "triton_scan",
          "union_build_tiles": 1,
          "union_build_warps": 1,
          # union_maxnreg: a register cap per thread for the union kernel, so that two 8-warp
          # programs share an SM (2 x 256 threads x 128 registers); with union_flat and
          # union_own_tma their shared memory fits too (98 KB each). Forward 27.6 -> 26.6 ms
          # at 131072 tokens despite the spills it causes (ADR 0003 v10). None: Triton's.
          # Applied only with the own block by TMA (union_register_cap).
          "union_maxnreg": 128,
          # union_flat: the whole-block loop takes one BN-key tile per step (a flat loop over
          # blocks x tiles) instead of unrolling a block's BS / BN tiles in each step, so the
          # pipeline keeps one K/V buffer per stage rather than one per tile of the block
          # (164 -> 98 KB of shared memory). Alone it is slower (29.9 ms, one program per SM);
          # it is what lets two programs share an SM (ADR 0003 v10).
          "union_flat": True,
          # union_own_tma: the own block is read by TMA too (no [BN, d] pointer tiles, whose
          # int64 addresses set the kernel's register count), with the values past a partial
          # last block zeroed; entries past the own block are skipped (no visible key). Needs
          # union_tma; part of the two-programs-per-SM configuration (ADR 0003 v10).
          "union_own_tma": True}


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, q2k_ptr, out_ptr, lse_ptr, tok_start_ptr, tok_pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_sg, stride_st, stride_lh,
    scale_log2, count_ptr, tok_tile_ptr, block_doc_ptr, block_local_ptr, cu_ptr, num_tiles,
    max_count, mass_ptr, stride_mg, stride_mt,
    TOPK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr,
    HYBRID: tl.constexpr, QT: tl.constexpr, TILE_GRID: tl.constexpr, TPP: tl.constexpr,
    KP: tl.constexpr, EMIT: tl.constexpr,
):
    """Per-token forward: one program per (token, KV head); with HYBRID it skips the tokens
    of the union kernel's tiles, and with TILE_GRID too there is one program per (``TPP``
    union tiles, KV head) doing the tiles' tokens one by one where the union kernel left
    them."""
    g = tl.program_id(1)
    if HYBRID and TILE_GRID:
        for j in range(TPP):
            n, start, p0 = tile_tokens_left(tl.program_id(0) * TPP + j, g, count_ptr,
                                            num_tiles, max_count, block_doc_ptr,
                                            block_local_ptr, cu_ptr, QT, BS)
            for i in range(n):
                _fwd_token(q_ptr, k_ptr, v_ptr, q2k_ptr, out_ptr, lse_ptr, start + p0 + i, g,
                           start, p0 + i, stride_qt, stride_qh, stride_kt, stride_kh,
                           stride_vt, stride_vh, stride_ot, stride_oh, stride_sg, stride_st,
                           stride_lh, scale_log2, mass_ptr, stride_mg, stride_mt, TOPK, G, GP,
                           BS, BN, D, FP32_DOT, KP, EMIT)
    else:
        t = tl.program_id(0)
        left = True
        if HYBRID:
            left = not token_taken_by_union(count_ptr, tok_tile_ptr, t, g, num_tiles, max_count)
        if left:
            _fwd_token(q_ptr, k_ptr, v_ptr, q2k_ptr, out_ptr, lse_ptr, t, g,
                       tl.load(tok_start_ptr + t), tl.load(tok_pos_ptr + t), stride_qt,
                       stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                       stride_oh, stride_sg, stride_st, stride_lh, scale_log2, mass_ptr,
                       stride_mg, stride_mt, TOPK, G, GP, BS, BN, D, FP32_DOT, KP, EMIT)


@triton.jit
def _fwd_token(q_ptr, k_ptr, v_ptr, q2k_ptr, out_ptr, lse_ptr, t, g, start, p,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_ot, stride_oh, stride_sg, stride_st, stride_lh, scale_log2,
               mass_ptr, stride_mg, stride_mt,
               TOPK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr,
               BN: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr,
               KP: tl.constexpr, EMIT: tl.constexpr):
    """Token ``t`` (document position ``p``, document start ``start``) x the G heads of KV
    head ``g`` over its ``TOPK`` selected blocks. With EMIT it also writes the group's mean
    attention mass per slot to ``mass[g, t, :]``."""
    rows = tl.arange(0, GP)
    hmask = rows < G
    heads = g * G + rows
    dd = tl.arange(0, D)
    t64 = t.to(tl.int64)
    q = tl.load(q_ptr + t64 * stride_qt + heads[:, None] * stride_qh + dd[None, :],
                mask=hmask[:, None], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    kk = tl.arange(0, KP)
    mass = tl.zeros((GP, KP), tl.float32)
    kn = tl.arange(0, BN)
    for s in range(TOPK):
        b = tl.load(q2k_ptr + g * stride_sg + t64 * stride_st + s)
        for c in tl.static_range(0, BS, BN):
            j = b * BS + c + kn
            kmask = (j <= p) & (b >= 0)
            k, v = load_kv_tile(k_ptr, v_ptr, (start + j).to(tl.int64), kmask, g, stride_kt,
                                stride_kh, stride_vt, stride_vh, D, FP32_DOT)
            sc = tl.dot(q, tl.trans(k)) * scale_log2
            sc = tl.where(kmask[None, :], sc, float("-inf"))
            m_i, l_i, acc, alpha, psum = online_softmax_step(sc, v, m_i, l_i, acc)
            if EMIT:
                mass = fold_block_mass(mass, alpha, psum, (kk == s)[None, :])
    out, lse = finish_softmax(m_i, l_i, acc)
    tl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + dd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    tl.store(lse_ptr + heads * stride_lh + t, lse, mask=hmask)
    if EMIT:
        # Padded head rows hold q = 0: their mass is real softmax mass and must be left out.
        head_mass = tl.where(hmask[:, None], finish_block_mass(mass, l_i), 0.0)
        tl.store(mass_ptr + g * stride_mg + t64 * stride_mt + kk, tl.sum(head_mass, axis=0) / G,
                 mask=kk < TOPK)


@triton.jit
def _fwd_union_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, q2k_ptr, out_ptr, lse_ptr, union_ptr, count_ptr,
    cu_ptr, block_doc_ptr, block_local_ptr, num_tiles, max_count,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_sg, stride_st, stride_lh, stride_ug, stride_ut,
    scale_log2, mass_ptr, stride_mg, stride_mt,
    TOPK: tl.constexpr, KP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    QT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    FP32_DOT: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr, UW: tl.constexpr,
    FLAT: tl.constexpr, OWN_TMA: tl.constexpr, EMIT: tl.constexpr,
):
    """Query-tile union: QT tokens of one document block x G heads share one pass over the
    union of their selected blocks; a row only sees blocks its own token selected.

    With SPLIT, the union entries before the tile's own block (whole blocks, every key visible
    to every row) run first without a per-score mask, read by TMA when TMA is set; the rest
    (the own block, and any entry past it) run with the causal mask and masked pointer loads.

    With EMIT each row also keeps its softmax mass per selected slot, and the group's mean per
    (token, slot) is written to ``mass``.
    """
    BM: tl.constexpr = QT * GP
    tile = tl.program_id(0)
    g = tl.program_id(1)
    doc, count, skipped = union_tile_skipped(tile, g, count_ptr, num_tiles, max_count,
                                             block_doc_ptr, QT, BS)
    if skipped:
        return
    start, length, pos, rmask, tok, heads, own = union_tile_rows(tile, g, doc, cu_ptr,
                                                                 block_local_ptr, G, GP, QT, BS)
    dd = tl.arange(0, D)
    q = load_rows(q_ptr, tok, heads, rmask, stride_qt, stride_qh, D)
    if FP32_DOT:
        q = q.to(tl.float32)
    selection = load_selection_rows(q2k_ptr, g, tok, rmask, stride_sg, stride_st, TOPK, KP)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    mass = tl.zeros((BM, KP), tl.float32)
    kn = tl.arange(0, BN)
    urow = union_ptr + g * stride_ug + tile * stride_ut
    full = union_full_blocks(urow, count, own, UW, SPLIT)
    if FLAT:
        for step in range(full * (BS // BN)):
            sel, k, v = union_flat_step(k_ptr, v_ptr, k_desc, v_desc, urow, step, selection,
                                        rmask, start, g, stride_kt, stride_kh, stride_vt,
                                        stride_vh, BS, BN, D, FP32_DOT, TMA)
            m_i, l_i, acc, alpha, psum = _fold_whole_tile(q, k, v, sel, m_i, l_i, acc,
                                                          scale_log2)
            if EMIT:
                b = tl.load(urow + step // (BS // BN))
                mass = fold_block_mass(mass, alpha, psum, selection == b)
    else:
        for u in range(full):
            b = tl.load(urow + u)
            sel = rows_selecting(selection, b) & rmask
            for c in tl.static_range(0, BS, BN):
                k, v = load_whole_kv_tile(k_ptr, v_ptr, k_desc, v_desc, start + b * BS + c, g,
                                          stride_kt, stride_kh, stride_vt, stride_vh, BN, D,
                                          FP32_DOT, TMA)
                m_i, l_i, acc, alpha, psum = _fold_whole_tile(q, k, v, sel, m_i, l_i, acc,
                                                              scale_log2)
                if EMIT:
                    mass = fold_block_mass(mass, alpha, psum, selection == b)
    # With OWN_TMA the loop is not pipelined: it is mostly the one own block, whose stage
    # buffers would add to the whole-block loop's in shared memory rather than reuse them.
    last = union_masked_end(urow, count, own, UW, OWN_TMA)
    for u in tl.range(full, last, num_stages=1 if OWN_TMA else None):
        b = tl.load(urow + u)
        sel = rows_selecting(selection, b) & rmask
        for c in tl.static_range(0, BS, BN):
            if OWN_TMA:
                k, v, vis = load_own_union_tile_tma(k_desc, v_desc, b * BS + c, start, length,
                                                    pos, sel, g, BN, D, FP32_DOT, False)
            else:
                k, v, vis = load_masked_union_tile(k_ptr, v_ptr, b * BS + c + kn, start, length,
                                                   pos, sel, g, stride_kt, stride_kh, stride_vt,
                                                   stride_vh, D, FP32_DOT)
            sc = tl.dot(q, tl.trans(k)) * scale_log2
            sc = tl.where(vis, sc, float("-inf"))
            m_i, l_i, acc, alpha, psum = online_softmax_step(sc, v, m_i, l_i, acc)
            if EMIT:
                mass = fold_block_mass(mass, alpha, psum, selection == b)
    out, lse = finish_softmax(m_i, l_i, acc)
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + dd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
    tl.store(lse_ptr + heads * stride_lh + tok, lse, mask=rmask)
    if EMIT:
        # Rows are token-major (row = i * GP + head): sum each token's heads.
        row_mass = tl.where(rmask[:, None], finish_block_mass(mass, l_i), 0.0)
        tok_mass = tl.sum(tl.reshape(row_mass, (QT, GP, KP)), axis=1) / G
        i = tl.arange(0, QT)
        p0 = own * BS + (tile % (BS // QT)) * QT
        kk = tl.arange(0, KP)
        tl.store(mass_ptr + g * stride_mg + (start + p0 + i)[:, None].to(tl.int64) * stride_mt
                 + kk[None, :], tok_mass, mask=((p0 + i) < length)[:, None] & (kk < TOPK)[None, :])


@triton.jit
def _fold_whole_tile(q, k, v, sel, m_i, l_i, acc, scale_log2):
    """Folds one whole key tile (every key visible to the rows ``sel``) into the union rows'
    online softmax; returns :func:`online_softmax_rows`'s five values."""
    return online_softmax_rows(tl.dot(q, tl.trans(k)), v, sel, m_i, l_i, acc, scale_log2)


@triton.jit
def _previous_of_segment(n1, prev1, last1, n2, prev2, last2):
    """Combine of a scan over segments ``(length, element before the last, last)``: the
    inclusive scan of ``(1, x_i, x_i)`` holds ``x_{i-1}`` in its middle part for ``i >= 1``."""
    return n1 + n2, tl.where(n2 >= 2, prev2, last1), last2


@triton.jit
def _tile_union_kernel(q2k_ptr, union_ptr, count_ptr, cu_ptr, block_doc_ptr, block_local_ptr,
                       stride_sg, stride_st, stride_ug, stride_ut, num_tiles,
                       TOPK: tl.constexpr, QT: tl.constexpr, BS: tl.constexpr,
                       WIDTH: tl.constexpr, W: tl.constexpr, TP: tl.constexpr):
    """``TP`` union tiles of one KV head: the sorted distinct blocks their tokens selected, in
    registers (no sort temporaries in memory), one [TP, W] row per tile.

    The entries are sorted; an entry is kept where it differs from its predecessor
    (:func:`_previous_of_segment`), and an inclusive count of the kept ones gives each its place
    in the list, so no second sort is needed."""
    BIG: tl.constexpr = 2147483647
    tiles = tl.program_id(0) * TP + tl.arange(0, TP)
    g = tl.program_id(1)
    live = tiles < num_tiles
    doc, start, length, p0 = union_tile_span(tl.minimum(tiles, num_tiles - 1), block_doc_ptr,
                                             block_local_ptr, cu_ptr, QT, BS)
    i = tl.arange(0, W)
    pos = p0[:, None] + (i // TOPK)[None, :]
    valid = ((live & (doc >= 0))[:, None] & (i < WIDTH)[None, :]) & (pos < length[:, None])
    ids = tl.load(q2k_ptr + g * stride_sg + (start[:, None] + pos).to(tl.int64) * stride_st
                  + (i % TOPK)[None, :], mask=valid, other=-1)
    key = tl.where(ids >= 0, ids, BIG)
    dst = union_ptr + g * stride_ug + tiles[:, None] * stride_ut
    key = tl.sort(key)
    n, prev, _ = tl.associative_scan((tl.full((TP, W), 1, tl.int32), key, key), 1,
                                     _previous_of_segment)
    kept = (key != BIG) & ((n < 2) | (prev != key))
    place = tl.cumsum(kept.to(tl.int32), axis=1) - 1
    count = tl.sum(kept.to(tl.int32), axis=1)
    # The kept entries go to places 0..count-1, zeros to count..WIDTH-1: disjoint stores.
    tl.store(dst + place, key, mask=live[:, None] & kept)
    tl.store(dst + i[None, :], tl.zeros((TP, W), tl.int32),
             mask=(live[:, None] & (i < WIDTH)[None, :]) & (i[None, :] >= count[:, None]))
    tl.store(count_ptr + g * num_tiles + tiles, count, mask=live)


#: Tiles per chunk of :func:`tile_unions`: bounds its temporaries (sort values and int64 sort
#: indices) to a few MiB whatever the sequence length; the chunk loop adds no host sync.
UNION_CHUNK_TILES = 8192


def tiles_per_program(config: dict, key: str) -> int:
    """``config[key]``: union tiles per program of a per-token tile grid, validated."""
    tpp = config[key]
    if not isinstance(tpp, int) or not 1 <= tpp <= 64:
        raise ValueError(f"CONFIG[{key!r}]={tpp!r}: expected an int in 1..64")
    return tpp


def union_build_launch(config: dict) -> tuple[int, int]:
    """``(tiles per program, warps)`` of the Triton union build from ``config`` (the keys
    ``union_build_tiles`` and ``union_build_warps`` of :data:`CONFIG`), validated."""
    tp, warps = config["union_build_tiles"], config["union_build_warps"]
    if not isinstance(tp, int) or tp < 1 or tp & (tp - 1):
        raise ValueError(f"CONFIG['union_build_tiles']={tp!r}: expected a power of two >= 1")
    if warps not in (1, 2, 4, 8):
        raise ValueError(f"CONFIG['union_build_warps']={warps!r}: expected 1, 2, 4 or 8")
    return tp, warps


def tile_unions(q2k: torch.Tensor, blocks, msa, qt: int):
    """Per (KV head, query tile of ``qt`` tokens of one document block): the sorted union of the
    tokens' selected blocks.

    Args:
        q2k: int32 [Hkv, T, top_k] document-local block ids, -1 for none.
        blocks: the doc-block map of the layout (:func:`doc_blocks`).
        msa: the layout; ``cu_seqlens`` and the host int ``max_seqlen`` are read.
        qt: tokens per tile; divides ``blocks.block_size``.

    Returns:
        ``(union int32 [Hkv, tiles, qt * top_k] (entries past ``count`` are 0), count int32
        [Hkv, tiles])`` with ``tiles = num_blocks_bound * block_size // qt``; device ops only.
        ``CONFIG["union_build"]`` picks torch sorts or the Triton kernel; both give the same.
    """
    q2k = q2k.contiguous()
    hkv, t, top_k = q2k.shape
    bs = blocks.block_size
    sub = bs // qt
    tiles = blocks.num_blocks_bound * sub
    dev = q2k.device
    width = qt * top_k
    build = CONFIG["union_build"]
    if build not in ("torch", "triton_scan"):
        raise ValueError(f"CONFIG['union_build']={build!r}: expected 'torch' or 'triton_scan'")
    if build != "torch":
        tp, warps = union_build_launch(CONFIG)
        union = torch.empty((hkv, tiles, width), dtype=torch.int32, device=dev)
        count = torch.empty((hkv, tiles), dtype=torch.int32, device=dev)
        _tile_union_kernel[(triton.cdiv(tiles, tp), hkv)](
            q2k, union, count, msa.cu_seqlens, blocks.block_doc, blocks.block_local,
            q2k.stride(0), q2k.stride(1), union.stride(0), union.stride(1), tiles,
            TOPK=top_k, QT=qt, BS=bs, WIDTH=width, W=next_pow2(width),
            TP=tp, num_warps=warps)
        return union, count
    # Local block ids stay below max_seqlen / bs: 16-bit sort keys when they fit.
    max_blocks = -(-int(getattr(msa, "max_seqlen", 2**31 - 1)) // bs)
    key_dtype = torch.int16 if max_blocks < 2**15 - 1 else torch.int32
    big = torch.iinfo(key_dtype).max
    union = torch.empty((hkv, tiles, width), dtype=torch.int32, device=dev)
    count = torch.empty((hkv, tiles), dtype=torch.int32, device=dev)
    cu = msa.cu_seqlens.long()
    for lo in range(0, tiles, UNION_CHUNK_TILES):
        hi = min(tiles, lo + UNION_CHUNK_TILES)
        tid = torch.arange(lo, hi, device=dev)
        blk = tid // sub
        doc = blocks.block_doc[blk].long()
        docc = doc.clamp(min=0)
        start = cu[docc]
        length = cu[docc + 1] - start
        pos = (blocks.block_local[blk].long() * bs + (tid % sub) * qt)[:, None] + torch.arange(
            qt, device=dev)
        valid = (doc >= 0)[:, None] & (pos < length[:, None])
        tok = torch.where(valid, start[:, None] + pos, 0).clamp(max=max(t - 1, 0))
        lists = q2k[:, tok.reshape(-1)].view(hkv, hi - lo, qt, top_k)
        keys = torch.where(valid[None, :, :, None] & (lists >= 0), lists, big).to(key_dtype)
        srt = torch.sort(keys.view(hkv, hi - lo, width), dim=-1).values
        dup = torch.zeros_like(srt, dtype=torch.bool)
        dup[..., 1:] = srt[..., 1:] == srt[..., :-1]
        srt = torch.sort(srt.masked_fill_(dup, big), dim=-1).values
        real = srt != big
        count[:, lo:hi] = real.sum(-1)
        union[:, lo:hi] = srt.masked_fill_(~real, 0)
    return union, count


#: The most rows (tokens x padded heads) of one union program. 256-row tiles (16 tokens of 16
#: heads) need more shared memory than an SM has at d = 128 (measured: 262 KB > 227 KB, forward
#: and dq, ADR 0003 v8).
MAX_UNION_ROWS = 128


@dataclass(frozen=True)
class HybridPlan:
    """The per-tile split of a hybrid launch (forward or dq) between union and per-token kernels.

    Attributes:
        qt: tokens per union tile; 0 when the union kernel is off.
        union: int32 [Hkv, tiles, qt * top_k] union lists (None when off).
        count: int32 [Hkv, tiles] union sizes; tiles with ``count <= max_count`` run the union
            kernel, the others the per-token kernel (a never-read placeholder when off).
        tok_tile: int32 [T] the tile of each token, for the per-token kernel's token grid
            (placeholder when off).
        num_tiles: tiles per KV head (0 when off).
        max_count: the largest union the union kernel takes.
    """

    qt: int
    union: torch.Tensor | None
    count: torch.Tensor
    tok_tile: torch.Tensor
    num_tiles: int
    max_count: int

    @property
    def enabled(self) -> bool:
        return self.qt > 0


@dataclass(frozen=True)
class TileUnions:
    """The union lists of one selection, kept by the forward for dq (same tiles, same lists):
    the backward then skips its own build (1.0 ms at 131072 tokens, ADR 0003 v11).

    Attributes:
        qt: tokens per union tile.
        union: int32 [Hkv, tiles, qt * top_k] sorted distinct blocks per tile (0 past count).
        count: int32 [Hkv, tiles] union sizes.
        source: ``(data_ptr, version, shape)`` of the q2k they were built from; the backward
            refuses them for another q2k, or one changed in place since.
    """

    qt: int
    union: torch.Tensor
    count: torch.Tensor
    source: tuple


def q2k_identity(q2k: torch.Tensor) -> tuple:
    """What ties :class:`TileUnions` to its q2k: storage address, in-place version, shape."""
    return q2k.data_ptr(), q2k._version, tuple(q2k.shape)


def union_tile_tokens(union_qt: int, block_size: int, gp: int) -> int:
    """Tokens per union tile for a requested ``union_qt`` (> 0): at most a block, and at most
    ``MAX_UNION_ROWS`` rows of ``gp`` padded heads."""
    return max(1, min(int(union_qt), block_size, MAX_UNION_ROWS // gp))


def hybrid_plan(q2k: torch.Tensor, blocks, msa, union_qt: int, union_max: int, gp: int,
                placeholder: torch.Tensor,
                unions: TileUnions | None = None) -> HybridPlan:
    """Builds the split for ``union_qt``-token tiles (capped so a tile has at most
    ``MAX_UNION_ROWS`` rows of ``gp`` padded heads), or a disabled plan whose tensors are
    ``placeholder`` when it is 0. ``unions`` built for the same tile size (the forward's, checked
    against q2k by the caller) are used instead of building the lists again."""
    if union_qt <= 0:
        return HybridPlan(0, None, placeholder, placeholder, 0, 0)
    bs = blocks.block_size
    qt = union_tile_tokens(union_qt, bs, gp)
    if unions is not None and unions.qt == qt:
        union, count = unions.union, unions.count
    else:
        union, count = tile_unions(q2k, blocks, msa, qt)
    tok_tile = ((blocks.doc_first_block[msa.token_documents.long()] + blocks.token_pos // bs)
                * (bs // qt) + (blocks.token_pos % bs) // qt).to(torch.int32)
    return HybridPlan(qt, union, count, tok_tile, union.shape[1], int(union_max))


def union_register_cap(maxnreg, own_tma: bool):
    """The union kernel's register cap: ``maxnreg`` (``CONFIG["union_maxnreg"]``) when its own
    block is read by TMA, else None. With pointer-loaded own-block tiles the cap spills their
    addresses (36 ms against 29.9 uncapped at 131072 tokens, ADR 0003 v10), as on GPUs without
    TMA."""
    return maxnreg if own_tma else None


def check_attention_inputs(q, k, v, q2k, msa, block_size):
    """Validates the shared inputs of the forward and backward; returns (T, Hq, Hkv, d, G, K)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be bf16 or fp16, got {x.dtype}")
        if x.dim() != 3:
            raise ValueError(f"{name} must be [T, heads, d], got shape {tuple(x.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    t, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T={t}, Hkv, d={d}]"
                         f" like q {tuple(q.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads Hq={hq} must be a multiple of KV heads Hkv={hkv}")
    if q2k.dtype != torch.int32 or q2k.dim() != 3 or q2k.shape[:2] != (hkv, t):
        raise ValueError(f"q2k must be int32 [Hkv={hkv}, T={t}, top_k], got {q2k.dtype} "
                         f"{tuple(q2k.shape)}")
    if not 1 <= q2k.shape[2] <= 32:
        raise ValueError(f"q2k top_k={q2k.shape[2]}: expected 1..32")
    if d not in (16, 32, 64, 128):
        raise ValueError(f"head dim d={d}: expected one of 16, 32, 64, 128")
    if block_size not in (16, 32, 64, 128):
        raise ValueError(f"block_size={block_size}: expected one of 16, 32, 64, 128")
    if t != getattr(msa, "num_tokens", t):
        raise ValueError(f"q has T={t} tokens but msa.num_tokens={msa.num_tokens}")
    check_kernel_devices(msa, q=q, k=k, v=v, q2k=q2k)
    return t, hq, hkv, d, hq // hkv, q2k.shape[2]


def triton_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             q2k: torch.Tensor, msa, softmax_scale: float | None = None, *,
                             block_size: int | None = None, return_unions: bool = False,
                             return_block_mass: bool = False):
    """Sparse MSA attention forward over the selected key blocks.

    Args:
        q: bf16/fp16 [T, Hq, d] queries in compact token order.
        k: same dtype [T, Hkv, d] keys; ``Hq`` is a multiple of ``Hkv``.
        v: same dtype [T, Hkv, d] values.
        q2k: int32 [Hkv, T, top_k] document-local block ids per (KV head, token), -1 = none.
        msa: the microbatch layout (``MSAMicrobatch``): ``cu_seqlens``, ``token_documents``,
            ``document_positions``, host ints ``num_tokens``, ``num_documents``, ``block_size``.
        softmax_scale: score scale; ``1 / sqrt(d)`` when None.
        block_size: key block size; defaults to ``msa.block_size``.
        return_unions: also return the tiles' union lists (:class:`TileUnions`, or None when
            the union kernel is off), for :func:`triton_attention_backward`'s ``unions``.
        return_block_mass: also return the attention mass per selected slot, fp32
            [Hkv, T, top_k]: for slot s of ``q2k[g, t]``, the softmax probability of the keys
            of that block summed, averaged over the group's query heads (0 at -1 slots). It is
            accumulated in the same pass over K/V (the indexer loss's target, no recompute).

    Returns:
        ``(out, lse)``: out [T, Hq, d] in q's dtype; lse fp32 [Hq, T], the natural log-sum-exp
        of the scaled scores (-inf and out = 0 for a query with no visible key).
        ``unions`` (with ``return_unions``) and then ``block_mass`` (with
        ``return_block_mass``) follow in that order.

    Raises:
        ValueError: on a bad argument (the message names it, its value and the expectation).
    """
    bs = int(block_size if block_size is not None else getattr(msa, "block_size", 128))
    t, hq, hkv, d, grp, top_k = check_attention_inputs(q, k, v, q2k, msa, bs)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    out = torch.empty_like(q)
    lse = torch.empty((hq, t), dtype=torch.float32, device=q.device)
    mass = (torch.empty((hkv, t, top_k), dtype=torch.float32, device=q.device)
            if return_block_mass else lse)
    emit = {"mass": mass, "emit": return_block_mass}
    if t == 0:
        return _forward_result(out, lse, None, emit, return_unions)
    blocks = doc_blocks(msa, bs)
    q_, k_, v_ = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    q2k_ = q2k.contiguous()
    gp = max(16, next_pow2(grp))
    bn = min(bs, CONFIG["bn"]) if d == 128 else bs
    plan = hybrid_plan(q2k_, blocks, msa, CONFIG["union_qt"], CONFIG["union_max"], gp, lse)
    if plan.enabled:
        ubn = min(bs, CONFIG["union_bn"]) if d == 128 else bs
        descs = (kv_descriptors(k_, v_, ubn, INTERPRET)
                 if CONFIG["union_split"] and CONFIG["union_tma"] else None)
        own_tma = descs is not None and bool(CONFIG["union_own_tma"])
        _fwd_union_kernel[(plan.num_tiles, hkv)](
            q_, k_, v_, *(descs or (k_, v_)), q2k_, out, lse, plan.union, plan.count,
            msa.cu_seqlens, blocks.block_doc, blocks.block_local, plan.num_tiles,
            plan.max_count,
            q_.stride(0), q_.stride(1), k_.stride(0), k_.stride(1), v_.stride(0), v_.stride(1),
            out.stride(0), out.stride(1), q2k_.stride(0), q2k_.stride(1), lse.stride(0),
            plan.union.stride(0), plan.union.stride(1), scale * LOG2E,
            mass, *_mass_strides(mass, return_block_mass), EMIT=return_block_mass,
            TOPK=top_k, KP=next_pow2(top_k), G=grp, GP=gp, QT=plan.qt, BS=bs, BN=ubn, D=d,
            FP32_DOT=INTERPRET, SPLIT=bool(CONFIG["union_split"]), TMA=descs is not None,
            UW=next_pow2(plan.union.shape[2]), FLAT=bool(CONFIG["union_flat"]),
            OWN_TMA=own_tma,
            num_warps=CONFIG["union_warps"], num_stages=CONFIG["union_stages"],
            **register_cap(union_register_cap(CONFIG["union_maxnreg"], own_tma), INTERPRET),
        )
    tile_grid = plan.enabled and bool(CONFIG["tile_grid"])
    tpp = tiles_per_program(CONFIG, "tile_grid_tiles") if tile_grid else 1
    _fwd_kernel[(triton.cdiv(plan.num_tiles, tpp) if tile_grid else t, hkv)](
        q_, k_, v_, q2k_, out, lse, blocks.token_start, blocks.token_pos,
        q_.stride(0), q_.stride(1), k_.stride(0), k_.stride(1), v_.stride(0), v_.stride(1),
        out.stride(0), out.stride(1), q2k_.stride(0), q2k_.stride(1), lse.stride(0),
        scale * LOG2E, plan.count, plan.tok_tile, blocks.block_doc, blocks.block_local,
        msa.cu_seqlens, plan.num_tiles, plan.max_count,
        mass, *_mass_strides(mass, return_block_mass), KP=next_pow2(top_k),
        EMIT=return_block_mass,
        TOPK=top_k, G=grp, GP=gp, BS=bs, BN=bn, D=d, FP32_DOT=INTERPRET,
        HYBRID=plan.enabled, QT=max(plan.qt, 1),
        TILE_GRID=tile_grid, TPP=tpp,
        num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"],
    )
    unions = (TileUnions(plan.qt, plan.union, plan.count, q2k_identity(q2k)) if plan.enabled
              else None)
    return _forward_result(out, lse, unions, emit, return_unions)


def _mass_strides(mass: torch.Tensor, emit: bool) -> tuple[int, int]:
    """(KV-head, token) strides of the block-mass output, 0 when it is not written."""
    return (mass.stride(0), mass.stride(1)) if emit else (0, 0)


def _forward_result(out, lse, unions, emit: dict, return_unions: bool) -> tuple:
    """``(out, lse[, unions][, block_mass])`` as :func:`triton_attention_forward` returns."""
    result = (out, lse) + ((unions,) if return_unions else ())
    return result + ((emit["mass"],) if emit["emit"] else ())
