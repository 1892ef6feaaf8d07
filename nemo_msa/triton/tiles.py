"""@triton.jit building blocks shared by the MSA kernels (inlined by Triton at compile time).

Every attention kernel reads one [N, d] tile of K and V of one KV head from a list of compact
token rows, and the query-outer forwards fold it into an exp2-domain online softmax. Keeping
those steps here gives every kernel the same masking and the same interpreter rule (dot operands
cast to fp32 under ``TRITON_INTERPRET=1``, see PLATFORM.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (Triton >= 3.3); the kernels fall back to pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

LOG2E = 1.4426950408889634  # host float (softmax scale -> log2 domain)
# The same constants for use inside kernels: Triton reads only constexpr globals.
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(0.6931471805599453)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1); Triton tile sizes must be powers of two."""
    return 1 << max(0, (x - 1).bit_length())


@triton.jit
def advance(ptr, index, stride):
    """``ptr + index * stride`` with the product in int64: the base of row (or head) ``index``
    of a tensor whose elements can pass 2^31 (``index`` a scalar or a vector). Triton types an
    integer argument below 2^31 as int32, and an int32 index times an int32 stride wraps there
    (ADR 0051); the cast costs one conversion per program where ``index`` is per program."""
    return ptr + index.to(tl.int64) * stride


@triton.jit
def max_keep_nan(a, b):
    """max(a, b) that returns NaN when either is NaN (``tl.max`` drops NaN: it lowers to the
    IEEE maxNum; ``max.NaN.f32`` keeps it at the same instruction cost)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_max_keep_nan(s):
    """fp32 [R, N] -> [R]: each row's max, NaN when the row holds a NaN (like torch.amax)."""
    return tl.reduce(s, 1, max_keep_nan)


@triton.jit
def doc_block(blk, block_doc_ptr, block_local_ptr, cu_ptr):
    """Global block ``blk`` of the doc-block map (``kernel_layout.KernelLayout``): ``(doc,
    local block, document start row, document length)``. ``doc`` is -1 for the surplus ids
    past the last block; their start and length are then document 0's (never used)."""
    doc = tl.load(block_doc_ptr + blk)
    docc = tl.maximum(doc, 0)
    start = tl.load(cu_ptr + docc)
    return doc, tl.load(block_local_ptr + blk), start, tl.load(cu_ptr + docc + 1) - start


@triton.jit
def union_tile_span(tile, block_doc_ptr, block_local_ptr, cu_ptr, QT: tl.constexpr,
                    BS: tl.constexpr):
    """Union tile ``tile`` (QT consecutive tokens of one document block, ``BS / QT`` tiles per
    block): ``(doc, start, length, p0)``, its document (-1 past the last block), the
    document's first compact row and length, and the document position of its first token."""
    SUB: tl.constexpr = BS // QT
    doc, local, start, length = doc_block(tile // SUB, block_doc_ptr, block_local_ptr, cu_ptr)
    return doc, start, length, local * BS + (tile % SUB) * QT


@triton.jit
def load_kv_tile(k_ptr, v_ptr, rows, mask, g, stride_kt, stride_kh, stride_vt, stride_vh,
                 D: tl.constexpr, FP32_DOT: tl.constexpr):
    """K and V of KV head ``g`` at compact rows ``rows`` (int64 [N]): two [N, D] tiles, zero
    where ``mask`` is False; fp32 when ``FP32_DOT`` (the interpreter), else the input dtype."""
    dd = tl.arange(0, D)
    k = tl.load(k_ptr + rows[:, None] * stride_kt + g * stride_kh + dd[None, :],
                mask=mask[:, None], other=0.0)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + g * stride_vh + dd[None, :],
                mask=mask[:, None], other=0.0)
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


def register_cap(maxnreg, interpret: bool) -> dict:
    """Launch options that cap a compiled kernel's registers per thread (``maxnreg``), or none
    for None and under the interpreter (which takes no such option)."""
    if maxnreg is None or interpret:
        return {}
    return {"maxnreg": int(maxnreg)}


def tma_supported(x: torch.Tensor, interpret: bool) -> bool:
    """Whether kernels may read ``x`` by TMA: the interpreter, or a Triton with host tensor
    descriptors on a Hopper-or-newer GPU (compute capability >= 9)."""
    if TensorDescriptor is None:
        return False
    if interpret:
        return True
    return x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] >= 9


def tma_rows(x: torch.Tensor) -> bool:
    """Whether TMA can read ``x`` [T, ...] as a 2-D [T, width] matrix: the trailing dims dense,
    the base and the row stride 16-byte aligned."""
    width, dense = 1, True
    for dim in range(x.dim() - 1, 0, -1):
        dense = dense and x.stride(dim) == width
        width *= x.shape[dim]
    return dense and x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0


def row_descriptor(x: torch.Tensor, rows: int, cols: int, interpret: bool):
    """A TMA descriptor over ``x`` [T, ...] seen as a 2-D [T, width] matrix with [rows, cols]
    boxes, or None where TMA cannot read it (see :func:`tma_supported` and :func:`tma_rows`)
    or T is 0.

    A kernel then reads rows ``[r, r + rows)`` at columns ``[c, c + cols)`` as one bulk copy
    with ``desc.load([r, c])`` (rows past T read as zero) instead of a pointer per element.
    """
    if x.shape[0] == 0 or not tma_supported(x, interpret) or not tma_rows(x):
        return None
    return TensorDescriptor(x, [x.shape[0], x[0].numel()], [x.stride(0), 1], [rows, cols])


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, rows: int, interpret: bool):
    """TMA descriptors of k and v [T, Hkv, d] with [rows, d] boxes (KV head ``g`` of rows
    ``[r, r + rows)`` is the box at ``[r, g * d]``), or None when either cannot be one."""
    descs = tuple(row_descriptor(x, rows, x.shape[2], interpret) for x in (k, v))
    return None if None in descs else descs


@triton.jit
def load_kv_tile_tma(k_desc, v_desc, row, g, D: tl.constexpr, FP32_DOT: tl.constexpr):
    """K and V of KV head ``g``, compact rows ``[row, row + N)``, by TMA (see
    :func:`kv_descriptors`); every row must be a real key of the program's document."""
    k = k_desc.load([row, g * D])
    v = v_desc.load([row, g * D])
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def load_whole_kv_tile(k_ptr, v_ptr, k_desc, v_desc, row, g, stride_kt, stride_kh, stride_vt,
                       stride_vh, BN: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr,
                       TMA: tl.constexpr):
    """K and V of KV head ``g``, compact rows ``[row, row + BN)``, all inside the program's
    document: by TMA when ``TMA`` (see :func:`kv_descriptors`), else by pointer loads."""
    if TMA:
        k, v = load_kv_tile_tma(k_desc, v_desc, row, g, D, FP32_DOT)
    else:
        kn = tl.arange(0, BN)
        k, v = load_kv_tile(k_ptr, v_ptr, (row + kn).to(tl.int64), kn < BN, g, stride_kt,
                            stride_kh, stride_vt, stride_vh, D, FP32_DOT)
    return k, v


@triton.jit
def load_masked_union_tile(k_ptr, v_ptr, j, start, length, pos, sel, g, stride_kt, stride_kh,
                           stride_vt, stride_vh, D: tl.constexpr, FP32_DOT: tl.constexpr):
    """A union program's key tile that needs the mask (its own block, or an entry past it):
    K and V at document keys ``j`` (zero past the document end) and the bool [M, N] pairs
    visible to a row, i.e. ``j <= pos`` for the rows ``sel`` that selected the block."""
    k, v = load_kv_tile(k_ptr, v_ptr, (start + j).to(tl.int64), j < length, g, stride_kt,
                        stride_kh, stride_vt, stride_vh, D, FP32_DOT)
    return k, v, (j[None, :] <= pos[:, None]) & sel[:, None]


@triton.jit
def union_flat_step(k_ptr, v_ptr, k_desc, v_desc, urow, step, selection, rmask, start, g,
                    stride_kt, stride_kh, stride_vt, stride_vh, BS: tl.constexpr,
                    BN: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr,
                    TMA: tl.constexpr):
    """Step ``step`` of a union program's flat whole-block loop (one BN-key tile per step, so
    BS / BN steps per union entry and one K/V buffer per pipeline stage): ``(sel, k, v)``, the
    rows whose q2k lists ``selection`` [M, KP] hold the step's block (see
    :func:`rows_selecting`) and the tile's K and V."""
    SUB: tl.constexpr = BS // BN
    u = step // SUB
    b = tl.load(urow + u)
    sel = rows_selecting(selection, b) & rmask
    k, v = load_whole_kv_tile(k_ptr, v_ptr, k_desc, v_desc, start + b * BS + (step % SUB) * BN,
                              g, stride_kt, stride_kh, stride_vt, stride_vh, BN, D, FP32_DOT,
                              TMA)
    return sel, k, v


@triton.jit
def union_masked_end(union_row_ptr, count, own_block, UW: tl.constexpr, SKIP_PAST: tl.constexpr):
    """Where a union program's masked loop stops: ``count``, or with SKIP_PAST after the own
    block (the sorted entries past it hold no key visible to any row of the tile)."""
    if SKIP_PAST:
        return union_full_blocks(union_row_ptr, count, own_block + 1, UW)
    else:
        return count


@triton.jit
def load_own_union_tile_tma(k_desc, v_desc, j0, start, length, pos, sel, g, BN: tl.constexpr,
                            D: tl.constexpr, FP32_DOT: tl.constexpr):
    """:func:`load_masked_union_tile` by TMA for the tile of document keys ``j0 .. j0 + BN -
    1`` of the own block. Rows past a partial last block belong to the next document (or read
    as 0 past T): their V is zeroed, so that a probability of 0 never meets an inf there."""
    j = j0 + tl.arange(0, BN)
    k, v = load_kv_tile_tma(k_desc, v_desc, start + j0, g, D, FP32_DOT)
    inside = (j < length)[:, None]
    v = tl.where(inside, v, 0.0)
    return k, v, (j[None, :] <= pos[:, None]) & sel[:, None]


@triton.jit
def rows_selecting(lists, b):
    """bool [M]: the rows whose token's selection ``lists`` [M, KP] holds block ``b``."""
    return tl.max((lists == b).to(tl.int32), axis=1) > 0


@triton.jit
def online_softmax_rows(sc, v, sel, m_i, l_i, acc, scale_log2, GUARD: tl.constexpr):
    """:func:`online_softmax_step` for a key tile every key of which is visible to a selected
    row: no per-element mask. Rows with ``sel`` False leave the tile out; they subtract +inf,
    so the exponent and the scale are one fused multiply-add per score: their probabilities
    are exactly 0 and their factor ``alpha`` exactly 1. With GUARD they also keep their old
    accumulator (one select per row and output element: a NaN/Inf in the tile's K or V would
    otherwise reach them through 0 * NaN, ADR 0025); without it the tile's K and V must be
    finite (ADR 0032), and the accumulator is one fused rescale and MMA.

    Args:
        sc: fp32 [M, N] unscaled scores q k^T; sel: bool [M] rows that selected the block.
        v, m_i, l_i, acc: as in :func:`online_softmax_step`; scale_log2: softmax scale * log2 e.
        GUARD: keep the rows ``~sel`` out of the accumulator by a select.
    """
    m_new = tl.where(sel, tl.maximum(m_i, tl.max(sc, axis=1) * scale_log2), m_i)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    pr = tl.exp2(sc * scale_log2 - tl.where(sel, m_use, float("inf"))[:, None])
    psum = tl.sum(pr, axis=1)
    l_i = tl.where(sel, l_i * alpha + psum, l_i)
    if GUARD:
        acc = tl.where(sel[:, None], acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v), acc)
    else:
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
    return m_new, l_i, acc, alpha, psum


@triton.jit
def union_full_blocks(union_row_ptr, count, own_block, UW: tl.constexpr):
    """How many of a tile's ``count`` sorted union entries lie before the tile's own block:
    those blocks are whole (inside the document) and causally visible to every row."""
    uu = tl.arange(0, UW)
    entries = tl.load(union_row_ptr + uu, mask=uu < count, other=2147483647)
    return tl.sum((entries < own_block).to(tl.int32))


@triton.jit
def online_softmax_step(sc, v, m_i, l_i, acc):
    """Folds one key tile into the running softmax of each row.

    Args:
        sc: fp32 [M, N] scores in the log2 domain, -inf where a key is not visible.
        v: [N, D] values (the dot's operand dtype).
        m_i, l_i: fp32 [M] running max and sum; acc: fp32 [M, D] running output.

    Returns:
        The updated ``(m_i, l_i, acc)``, then ``alpha`` [M] (the factor that rescaled the old
        sums) and ``psum`` [M] (this tile's share of the new ``l_i``), for the per-block mass
        (:func:`fold_block_mass`). A row that has seen no visible key keeps m = -inf and is
        shifted by 0 instead, so it never produces NaN.
    """
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    pr = tl.exp2(sc - m_use[:, None])
    psum = tl.sum(pr, axis=1)
    l_i = l_i * alpha + psum
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
    return m_new, l_i, acc, alpha, psum


@triton.jit
def fold_block_mass(mass, alpha, psum, slot_hit):
    """Running per-slot softmax mass [M, KP]: rescaled like ``l_i`` and credited with the
    tile's ``psum`` in the slot ``slot_hit`` (bool [M, KP]) of the block the tile belongs to.
    Divided by the final ``l_i`` it is each row's attention mass per selected slot."""
    return mass * alpha[:, None] + tl.where(slot_hit, psum[:, None], 0.0)


@triton.jit
def finish_block_mass(mass, l_i):
    """[M, KP] normalized per-slot mass (0 for a row that saw no visible key)."""
    return mass / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def finish_softmax(m_i, l_i, acc):
    """The normalized output [M, D] and the natural-log LSE [M] (-inf and 0 for empty rows)."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))
    return out, tl.where(empty, float("-inf"), lse2 * LN2_C)


@triton.jit
def dq_tile(q, do, k, v, pr_mask, lse2, delta, scale_log2):
    """dS K of one key tile for the dq kernels (before the softmax scale).

    Args:
        q, do: [M, D] queries and output gradients; k, v: [N, D]; pr_mask: bool [M, N] visible
            (row, key) pairs; lse2: fp32 [M] LSE in the log2 domain; delta: fp32 [M]
            rowsum(dO * O).

    Returns:
        fp32 [M, D]: this tile's contribution to dq / scale.
    """
    sc = tl.dot(q, tl.trans(k)) * scale_log2
    pr = tl.where(pr_mask, tl.exp2(sc - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = pr * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k)


@triton.jit
def dq_tile_rows(q, do, k, v, sel, lse2, delta, scale_log2):
    """:func:`dq_tile` for a key tile every key of which is visible to a selected row; rows
    with ``sel`` False subtract +inf from their exponent, so their probabilities are 0."""
    sc = tl.dot(q, tl.trans(k))
    pr = tl.exp2(sc * scale_log2 - tl.where(sel, lse2, float("inf"))[:, None])
    dp = tl.dot(do, tl.trans(v))
    ds = pr * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k)


@triton.jit
def load_rows(ptr, tok, heads, mask, stride_t, stride_h, D: tl.constexpr):
    """Rows ``[tok, heads, :]`` of a [T, H, D] tensor as an [M, D] tile (0 where ~mask);
    ``tok`` int64 [M], ``heads`` [M] (one token: see :func:`token_rows`)."""
    dd = tl.arange(0, D)
    offsets = tok[:, None] * stride_t + heads[:, None] * stride_h + dd[None, :]
    return tl.load(ptr + offsets, mask=mask[:, None], other=0.0)


@triton.jit
def token_rows(t, heads):
    """Token ``t`` repeated for every row of ``heads``: int64 [M], for :func:`load_rows`."""
    return (heads * 0).to(tl.int64) + t.to(tl.int64)


@triton.jit
def union_tile_rows(tile, g, doc, cu_ptr, block_local_ptr, G: tl.constexpr, GP: tl.constexpr,
                    QT: tl.constexpr, BS: tl.constexpr):
    """The rows of a query-tile union program: QT tokens x GP (padded) heads, M = QT * GP.

    Tile ``tile`` covers tokens ``[QT * (tile % (BS / QT)), ...)`` of local block ``
    block_local[tile // (BS / QT)]`` of document ``doc``.

    Returns:
        ``(start, length, pos, rmask, tok, heads, own)``: the document's first compact row and
        length, then per row its document position, validity (real token, real head), int64
        compact token row and query head; last the tile's own local block.
    """
    SUB: tl.constexpr = BS // QT
    o = tl.load(block_local_ptr + tile // SUB)
    start = tl.load(cu_ptr + doc)
    length = tl.load(cu_ptr + doc + 1) - start
    r = tl.arange(0, QT * GP)
    pos = o * BS + (tile % SUB) * QT + r // GP
    hr = r % GP
    rmask = (pos < length) & (hr < G)
    return start, length, pos, rmask, (start + pos).to(tl.int64), g * G + hr, o


@triton.jit
def load_selection_rows(q2k_ptr, g, tok, rmask, stride_sg, stride_st, TOPK: tl.constexpr,
                        KP: tl.constexpr):
    """q2k[g, tok, :] as an int32 [M, KP] tile, -1 past TOPK and on masked rows."""
    kk = tl.arange(0, KP)
    return tl.load(advance(q2k_ptr, g, stride_sg) + tok[:, None] * stride_st + kk[None, :],
                   mask=rmask[:, None] & (kk[None, :] < TOPK), other=-1)


@triton.jit
def load_do_and_delta(do_ptr, o_ptr, delta_ptr, tok, heads, mask, stride_dot, stride_doh,
                      stride_ot, stride_oh, stride_lh, D: tl.constexpr):
    """dO rows [M, D] and ``delta = rowsum(dO * O)`` fp32 [M], also stored at
    ``delta[heads, tok]`` ([Hq, T]) for the dk/dv kernel."""
    do = load_rows(do_ptr, tok, heads, mask, stride_dot, stride_doh, D)
    o = load_rows(o_ptr, tok, heads, mask, stride_ot, stride_oh, D)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    tl.store(advance(delta_ptr, heads, stride_lh) + tok, delta, mask=mask)
    return do, delta


@triton.jit
def load_dq_rows(q_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, tok, heads, mask,
                 stride_qt, stride_qh, stride_dot, stride_doh, stride_ot, stride_oh, stride_lh,
                 D: tl.constexpr, FP32_DOT: tl.constexpr):
    """The per-row inputs of a dq program; also stores ``delta = rowsum(dO * O)`` [Hq, T] for
    the dk/dv kernel.

    Returns:
        ``(q, do, delta, lse2)``: [M, D] tiles (fp32 when ``FP32_DOT``), fp32 [M] delta and
        fp32 [M] LSE in the log2 domain.
    """
    q = load_rows(q_ptr, tok, heads, mask, stride_qt, stride_qh, D)
    do, delta = load_do_and_delta(do_ptr, o_ptr, delta_ptr, tok, heads, mask, stride_dot,
                                  stride_doh, stride_ot, stride_oh, stride_lh, D)
    lse2 = tl.load(advance(lse_ptr, heads, stride_lh) + tok, mask=mask, other=0.0) * LOG2E_C
    if FP32_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    return q, do, delta, lse2


@triton.jit
def csr_entry_rows(list_ptr, tok_pos_ptr, e, hi, r_tok, r_head, G: tl.constexpr):
    """Rows of one step of a KV-outer program over its block's query list (CSR entries
    ``[e, e + QT)`` x GP padded heads): ``(ent, rmask, tok int64, pos)`` per row."""
    ent = e + r_tok
    rmask = (ent < hi) & (r_head < G)
    tok = tl.load(list_ptr + ent, mask=rmask, other=0).to(tl.int64)
    pos = tl.load(tok_pos_ptr + tok, mask=rmask, other=-1)
    return ent, rmask, tok, pos


# ----------------------------------------------------------------------------- query subsets
# A query-subset launch (context parallelism, ADR 0021) runs the tiles of a list (the full
# launch's tile ids that hold a local query) and reads and writes the query side at local rows
# (``query_row``: global compact row -> local row, -1 for a token that is not a local query).
# With SUBSET False each helper is the identity of the full launch, so its code is unchanged.


@triton.jit
def subset_tile(slot, tiles_ptr, SUBSET: tl.constexpr):
    """The global tile id of entry ``slot`` of a launch's tile list (``slot`` itself when the
    launch runs every tile)."""
    tile = slot
    if SUBSET:
        tile = tl.load(tiles_ptr + slot)
    return tile


@triton.jit
def subset_rows(tok, mask, qrow_ptr, SUBSET: tl.constexpr):
    """Query-side rows of the global compact rows ``tok`` (int [M]): ``(rows int64, mask)``,
    the local rows and ``mask`` narrowed to the local queries (``tok`` and ``mask`` unchanged
    when every token is a query)."""
    rows = tok.to(tl.int64)
    if SUBSET:
        local = tl.load(qrow_ptr + rows, mask=mask, other=-1)
        mask = mask & (local >= 0)
        rows = tl.maximum(local, 0).to(tl.int64)
    return rows, mask


@triton.jit
def subset_union_tile_skipped(slot, g, count_ptr, num_tiles, max_count, block_doc_ptr, tiles_ptr,
                              QT: tl.constexpr, BS: tl.constexpr, SUBSET: tl.constexpr):
    """The hybrid split seen from a union program running entry ``slot`` of the tile list:
    ``(tile, doc, count, skipped)``, the global tile id, its document, the union size (read at
    the entry) and whether the tile is skipped: it lies past the last document block, or its
    union is larger than ``max_count`` (the per-token kernel then does its tokens, see
    :func:`subset_tile_tokens_left`)."""
    tile = subset_tile(slot, tiles_ptr, SUBSET)
    doc = tl.load(block_doc_ptr + tile // (BS // QT))
    count = tl.load(advance(count_ptr, g, num_tiles) + slot)
    return tile, doc, count, (doc < 0) | (count > max_count)


@triton.jit
def subset_tile_tokens_left(slot, g, count_ptr, num_tiles, max_count, block_doc_ptr,
                            block_local_ptr, cu_ptr, tiles_ptr, QT: tl.constexpr,
                            BS: tl.constexpr, SUBSET: tl.constexpr):
    """The split seen from a per-token program of the hybrid grid (one program per union tile,
    or several): ``(n, start, p0)``, the tokens of entry ``slot`` of the tile list left to it
    (document positions ``p0 .. p0 + n - 1`` of the document starting at compact row
    ``start``). ``n`` is 0 when the union kernel ran the tile (union of at most ``max_count``
    blocks), or the tile lies past the last document block, or ``slot`` is ``num_tiles`` or
    beyond; one program per tile or more, rather than per token, keeps the launch small when
    the union kernel takes nearly every tile. With SUBSET the ``n`` positions may include
    tokens that are not local queries (the caller skips them through ``query_row``)."""
    live = slot < num_tiles
    slot = tl.minimum(slot, num_tiles - 1)
    tile = subset_tile(slot, tiles_ptr, SUBSET)
    doc, start, length, p0 = union_tile_span(tile, block_doc_ptr, block_local_ptr, cu_ptr, QT,
                                             BS)
    count = tl.load(advance(count_ptr, g, num_tiles) + slot)
    n = tl.minimum(length - p0, QT)
    return tl.where((doc < 0) | (count <= max_count) | (~live), 0, n), start, p0
