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
is decided per tile on the device (no host sync); the union lists and the split are built in
:mod:`nemo_msa.attention.triton_union`. ADR 0003 gives the schedule's reasons.

Masking. Key ``j`` (document-local) of block ``b`` is visible to the query at position ``p``
iff ``b >= 0`` and ``j <= p``; ``j <= p`` also keeps the reads inside the document, so q2k
entries that are -1 or point past the own block cost a masked tile and contribute nothing.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nemo_msa.attention.triton_union import TileUnions, hybrid_plan, tensor_identity
from nemo_msa.triton.guards import (
    finite_values,
    nonfinite_row_counts,
    poison_rows,
    union_rows_finite,
)
from nemo_msa.triton.kernel_layout import (
    INTERPRET,
    check_attention_inputs,
    check_block_size,
    kernel_layout,
    query_subset,
    subset_pointers,
)
from nemo_msa.triton.launch import ForwardLaunch, current_launch
from nemo_msa.triton.tiles import (
    LOG2E,
    advance,
    finish_block_mass,
    finish_softmax,
    fold_block_mass,
    kv_descriptors,
    load_kv_tile,
    load_masked_union_tile,
    load_own_union_tile_tma,
    load_rows,
    load_selection_rows,
    next_pow2,
    online_softmax_rows,
    online_softmax_step,
    register_cap,
    rows_selecting,
    subset_rows,
    subset_tile_tokens_left,
    subset_union_tile_skipped,
    union_flat_step,
    union_full_blocks,
    union_masked_end,
    union_tile_rows,
)


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, q2k_ptr, out_ptr, lse_ptr, tok_start_ptr, tok_pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_sg, stride_st, stride_lh,
    scale_log2, count_ptr, block_doc_ptr, block_local_ptr, cu_ptr, num_tiles,
    max_count, mass_ptr, stride_mg, stride_mt, tiles_ptr, qrow_ptr,
    TOPK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr,
    HYBRID: tl.constexpr, QT: tl.constexpr, TPP: tl.constexpr,
    KP: tl.constexpr, EMIT: tl.constexpr, SUBSET: tl.constexpr,
):
    """Per-token forward: one program per (token, KV head); with HYBRID one program per
    (``TPP`` union tiles, KV head) doing the tiles' tokens one by one where the union kernel
    left them (a grid per tile, not per token: with coherent selections nearly every program
    finds its tiles taken and exits).

    With SUBSET (a query subset, ADR 0021) the per-token grid runs the local queries (the
    token tables are theirs) and a hybrid program's tiles come from the list ``tiles``; the
    tiles' tokens that are not local queries (``query_row`` -1) are skipped."""
    g = tl.program_id(1)
    if HYBRID:
        for j in range(TPP):
            n, start, p0 = subset_tile_tokens_left(tl.program_id(0) * TPP + j, g, count_ptr,
                                                   num_tiles, max_count, block_doc_ptr,
                                                   block_local_ptr, cu_ptr, tiles_ptr, QT, BS,
                                                   SUBSET)
            for i in range(n):
                if SUBSET:
                    lt = tl.load(qrow_ptr + start + p0 + i)
                    if lt >= 0:
                        _fwd_token(q_ptr, k_ptr, v_ptr, q2k_ptr, out_ptr, lse_ptr, lt, g,
                                   start, p0 + i, stride_qt, stride_qh, stride_kt, stride_kh,
                                   stride_vt, stride_vh, stride_ot, stride_oh, stride_sg,
                                   stride_st, stride_lh, scale_log2, mass_ptr, stride_mg,
                                   stride_mt, TOPK, G, GP, BS, BN, D, FP32_DOT, KP, EMIT)
                else:
                    _fwd_token(q_ptr, k_ptr, v_ptr, q2k_ptr, out_ptr, lse_ptr, start + p0 + i,
                               g, start, p0 + i, stride_qt, stride_qh, stride_kt, stride_kh,
                               stride_vt, stride_vh, stride_ot, stride_oh, stride_sg,
                               stride_st, stride_lh, scale_log2, mass_ptr, stride_mg,
                               stride_mt, TOPK, G, GP, BS, BN, D, FP32_DOT, KP, EMIT)
    else:
        t = tl.program_id(0)
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
    q2k_row = advance(q2k_ptr, g, stride_sg) + t64 * stride_st
    for s in range(TOPK):
        b = tl.load(q2k_row + s)
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
    tl.store(advance(lse_ptr, heads, stride_lh) + t64, lse, mask=hmask)
    if EMIT:
        # Padded head rows hold q = 0: their mass is real softmax mass and must be left out.
        head_mass = tl.where(hmask[:, None], finish_block_mass(mass, l_i), 0.0)
        tl.store(advance(mass_ptr, g, stride_mg) + t64 * stride_mt + kk,
                 tl.sum(head_mass, axis=0) / G, mask=kk < TOPK)


@triton.jit
def _fwd_union_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, q2k_ptr, out_ptr, lse_ptr, union_ptr, count_ptr,
    cu_ptr, block_doc_ptr, block_local_ptr, num_tiles, max_count,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_sg, stride_st, stride_lh, stride_ug, stride_ut,
    scale_log2, mass_ptr, stride_mg, stride_mt, tiles_ptr, qrow_ptr, nonfinite_ptr,
    stride_ng,
    TOPK: tl.constexpr, KP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    QT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    FP32_DOT: tl.constexpr, TMA: tl.constexpr, UW: tl.constexpr,
    OWN_TMA: tl.constexpr, EMIT: tl.constexpr, SUBSET: tl.constexpr, GUARD: tl.constexpr,
):
    """Query-tile union: QT tokens of one document block x G heads share one pass over the
    union of their selected blocks; a row only sees blocks its own token selected.

    The union entries before the tile's own block (whole blocks, every key visible to every
    row) run first without a per-score mask, read by TMA when TMA is set; the rest (the own
    block, and any entry past it) run with the causal mask.

    The kernel is launched twice (ADR 0032): without GUARD a program runs only where the K and
    V rows of its blocks (the document's rows of each entry it reads) are all finite
    (``nonfinite``, the common case) and folds them without the NaN/Inf guards; with GUARD
    only where they are not. Two kernels rather than a branch: in one kernel the guarded
    loop's second accumulator costs the other loop its registers too.

    With EMIT each row also keeps its softmax mass per selected slot, and the group's mean per
    (token, slot) is written to ``mass``.

    With SUBSET the program runs entry ``program_id(0)`` of the tile list ``tiles`` and its
    rows are the tile's local queries (read and written at their local rows, ``query_row``).
    """
    BM: tl.constexpr = QT * GP
    slot = tl.program_id(0)
    g = tl.program_id(1)
    tile, doc, count, skipped = subset_union_tile_skipped(slot, g, count_ptr, num_tiles,
                                                          max_count, block_doc_ptr, tiles_ptr,
                                                          QT, BS, SUBSET)
    if skipped:
        return
    start, length, pos, rmask, tok, heads, own = union_tile_rows(tile, g, doc, cu_ptr,
                                                                 block_local_ptr, G, GP, QT, BS)
    urow = advance(advance(union_ptr, g, stride_ug), slot, stride_ut)
    full = union_full_blocks(urow, count, own, UW)
    last = union_masked_end(urow, count, own, UW, OWN_TMA)
    # Before any Q load: every program of the two launches gets here, half of them to exit.
    if union_rows_finite(nonfinite_ptr, g, stride_ng, urow, last, start, length, BS,
                         UW) == GUARD:
        return  # the other launch's program (ADR 0032)
    tok, rmask = subset_rows(tok, rmask, qrow_ptr, SUBSET)
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
    m_i, l_i, acc, mass = _whole_block_loop(
        q, k_ptr, v_ptr, k_desc, v_desc, urow, full, selection, rmask, start, g, stride_kt,
        stride_kh, stride_vt, stride_vh, m_i, l_i, acc, mass, scale_log2, BS, BN, D, FP32_DOT,
        TMA, EMIT, GUARD)
    # With OWN_TMA the loop is not pipelined: it is mostly the one own block, whose stage
    # buffers would add to the whole-block loop's in shared memory rather than reuse them.
    poisoned = rmask != rmask  # rows that see a NaN/Inf value in a masked tile
    for u in tl.range(full, last, num_stages=1 if OWN_TMA else None):
        b = tl.load(urow + u)
        sel = rows_selecting(selection, b) & rmask
        for c in tl.static_range(0, BS, BN):
            if OWN_TMA:
                k, v, vis = load_own_union_tile_tma(k_desc, v_desc, b * BS + c, start, length,
                                                    pos, sel, g, BN, D, FP32_DOT)
            else:
                k, v, vis = load_masked_union_tile(k_ptr, v_ptr, b * BS + c + kn, start, length,
                                                   pos, sel, g, stride_kt, stride_kh, stride_vt,
                                                   stride_vh, D, FP32_DOT)
            sc = tl.dot(q, tl.trans(k)) * scale_log2
            sc = tl.where(vis, sc, float("-inf"))
            if GUARD:
                # A masked pair's probability is 0: a NaN/Inf value must not meet it in P V.
                v, poisoned = finite_values(v, vis, poisoned)
            m_i, l_i, acc, alpha, psum = online_softmax_step(sc, v, m_i, l_i, acc)
            if EMIT:
                mass = fold_block_mass(mass, alpha, psum, selection == b)
    out, lse = finish_softmax(m_i, l_i, acc)
    out = poison_rows(out, poisoned)
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + dd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
    tl.store(advance(lse_ptr, heads, stride_lh) + tok, lse, mask=rmask)
    if EMIT:
        # Rows are token-major (row = i * GP + head): sum each token's heads.
        row_mass = tl.where(rmask[:, None], finish_block_mass(mass, l_i), 0.0)
        tok_mass = tl.sum(tl.reshape(row_mass, (QT, GP, KP)), axis=1) / G
        i = tl.arange(0, QT)
        p0 = own * BS + (tile % (BS // QT)) * QT
        kk = tl.arange(0, KP)
        mrow, mok = subset_rows(start + p0 + i, (p0 + i) < length, qrow_ptr, SUBSET)
        tl.store(advance(mass_ptr, g, stride_mg) + mrow[:, None] * stride_mt + kk[None, :],
                 tok_mass, mask=mok[:, None] & (kk < TOPK)[None, :])


@triton.jit
def _whole_block_loop(q, k_ptr, v_ptr, k_desc, v_desc, urow, full, selection, rmask, start, g,
                      stride_kt, stride_kh, stride_vt, stride_vh, m_i, l_i, acc, mass,
                      scale_log2, BS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                      FP32_DOT: tl.constexpr, TMA: tl.constexpr, EMIT: tl.constexpr,
                      GUARD: tl.constexpr):
    """The union kernel's first ``full`` entries (whole blocks, every key visible to the rows
    that selected them) folded into ``(m_i, l_i, acc, mass)``, one key tile per step (one K/V
    buffer per pipeline stage, so that two programs fit an SM's shared memory). GUARD: the
    tiles may hold a NaN/Inf (:func:`online_softmax_rows`)."""
    for step in range(full * (BS // BN)):
        sel, k, v = union_flat_step(k_ptr, v_ptr, k_desc, v_desc, urow, step, selection,
                                    rmask, start, g, stride_kt, stride_kh, stride_vt,
                                    stride_vh, BS, BN, D, FP32_DOT, TMA)
        m_i, l_i, acc, alpha, psum = online_softmax_rows(tl.dot(q, tl.trans(k)), v, sel, m_i,
                                                         l_i, acc, scale_log2, GUARD)
        if EMIT:
            b = tl.load(urow + step // (BS // BN))
            mass = fold_block_mass(mass, alpha, psum, selection == b)
    return m_i, l_i, acc, mass


def union_register_cap(maxnreg, own_tma: bool):
    """The union kernel's register cap: ``maxnreg`` (``ForwardLaunch.union_maxnreg``) when its
    own block is read by TMA, else None: with pointer-loaded own-block tiles the cap spills
    their int64 addresses in the hot loop, as on GPUs without TMA."""
    return maxnreg if own_tma else None


def triton_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             q2k: torch.Tensor, msa, softmax_scale: float | None = None, *,
                             block_size: int | None = None, return_unions: bool = False,
                             return_block_mass: bool = False,
                             launch: ForwardLaunch | None = None,
                             queries: torch.Tensor | None = None):
    """Sparse MSA attention forward over the selected key blocks.

    Args:
        q: bf16/fp16 [T, Hq, d] queries in compact token order.
        k: same dtype [T, Hkv, d] keys; ``Hq`` is a multiple of ``Hkv``.
        v: same dtype [T, Hkv, d] values.
        q2k: int32 [Hkv, T, top_k] document-local block ids per (KV head, token), -1 = none.
        msa: the microbatch layout (``MSAMicrobatch``, or a
            :class:`~nemo_msa.triton.kernel_layout.KernelLayout`; see
            :func:`~nemo_msa.triton.kernel_layout.kernel_layout`).
        softmax_scale: score scale; ``1 / sqrt(d)`` when None.
        block_size: key block size; defaults to ``msa.block_size``.
        return_unions: also return the tiles' union lists (:class:`TileUnions`, or None when
            the union kernel is off), for :func:`triton_attention_backward`'s ``unions``.
        return_block_mass: also return the attention mass per selected slot, fp32
            [Hkv, T, top_k]: for slot s of ``q2k[g, t]``, the softmax probability of the keys
            of that block summed, averaged over the group's query heads (0 at -1 slots). It is
            accumulated in the same pass over K/V (the indexer loss's target, no recompute).
        launch: launch parameters; None takes
            :func:`~nemo_msa.triton.launch.current_launch` ``("fwd")``.
        queries: int64 [Tq] global compact rows of the local queries (context parallelism:
            ascending, unique), or None for every token. With it q, q2k, out, lse and the
            block mass have Tq rows (in that order) and k / v the layout's T rows; each row
            equals the full launch's row of its token (ADR 0021).

    Returns:
        ``(out, lse)``: out [T, Hq, d] in q's dtype; lse fp32 [Hq, T], the natural log-sum-exp
        of the scaled scores (-inf and out = 0 for a query with no visible key).
        ``unions`` (with ``return_unions``) and then ``block_mass`` (with
        ``return_block_mass``) follow in that order.

    Raises:
        ValueError: on a bad argument (the message names it, its value and the expectation).
    """
    cfg = current_launch("fwd") if launch is None else launch
    bs = int(block_size if block_size is not None else msa.block_size)
    check_block_size(bs)
    view = kernel_layout(msa, bs)
    subset = query_subset(msa, bs, queries)
    t, hq, hkv, d, grp, top_k = check_attention_inputs(q, k, v, q2k, view, subset)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    out = torch.empty_like(q)
    lse = torch.empty((hq, t), dtype=torch.float32, device=q.device)
    mass = (torch.empty((hkv, t, top_k), dtype=torch.float32, device=q.device)
            if return_block_mass else lse)
    emit = {"mass": mass, "emit": return_block_mass}
    if t == 0:
        return _forward_result(out, lse, None, emit, return_unions)
    q_, k_, v_ = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    q2k_ = q2k.contiguous()
    gp = max(16, next_pow2(grp))
    plan = hybrid_plan(q2k_, view, cfg.union_qt, cfg.union_max, gp, lse,
                       build_tiles=cfg.union_build_tiles, build_warps=cfg.union_build_warps,
                       subset=subset)
    tensors = dict(q_ptr=q_, k_ptr=k_, v_ptr=v_, q2k_ptr=q2k_, out_ptr=out, lse_ptr=lse,
                   count_ptr=plan.count, block_doc_ptr=view.block_doc,
                   block_local_ptr=view.block_local, cu_ptr=view.cu_seqlens,
                   num_tiles=plan.num_tiles, max_count=plan.max_count, mass_ptr=mass,
                   **subset_pointers(subset, plan.qt, view))
    strides = dict(stride_qt=q_.stride(0), stride_qh=q_.stride(1), stride_kt=k_.stride(0),
                   stride_kh=k_.stride(1), stride_vt=v_.stride(0), stride_vh=v_.stride(1),
                   stride_ot=out.stride(0), stride_oh=out.stride(1), stride_sg=q2k_.stride(0),
                   stride_st=q2k_.stride(1), stride_lh=lse.stride(0),
                   **_mass_strides(mass, return_block_mass))
    shape = dict(TOPK=top_k, KP=next_pow2(top_k), G=grp, GP=gp, BS=bs, D=d,
                 FP32_DOT=INTERPRET, EMIT=return_block_mass, SUBSET=subset is not None)
    nonfinite = nonfinite_row_counts(k_, v_) if plan.enabled else None
    if plan.enabled:
        ubn = min(bs, cfg.union_bn) if d == 128 else bs
        descs = kv_descriptors(k_, v_, ubn, INTERPRET) if cfg.union_tma else None
        own_tma = descs is not None and cfg.union_own_tma
        k_desc, v_desc = descs or (k_, v_)
        for guard in (False, True):
            _fwd_union_kernel[(plan.num_tiles, hkv)](
                **tensors, **strides, k_desc=k_desc, v_desc=v_desc, union_ptr=plan.union,
                nonfinite_ptr=nonfinite, stride_ng=nonfinite.stride(0),
                stride_ug=plan.union.stride(0), stride_ut=plan.union.stride(1),
                scale_log2=scale * LOG2E, **shape, QT=plan.qt, BN=ubn,
                TMA=descs is not None, UW=next_pow2(plan.union.shape[2]), OWN_TMA=own_tma,
                GUARD=guard, num_warps=cfg.union_warps, num_stages=cfg.union_stages,
                **register_cap(union_register_cap(cfg.union_maxnreg, own_tma), INTERPRET),
            )
    tpp = cfg.tile_grid_tiles if plan.enabled else 1
    _fwd_kernel[(triton.cdiv(plan.num_tiles, tpp) if plan.enabled else t, hkv)](
        **tensors, **strides, tok_start_ptr=(subset or view).token_start,
        tok_pos_ptr=(subset or view).token_pos, scale_log2=scale * LOG2E, **shape,
        BN=min(bs, cfg.bn) if d == 128 else bs, HYBRID=plan.enabled, QT=max(plan.qt, 1),
        TPP=tpp, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    unions = (TileUnions(plan.qt, plan.union, plan.count, tensor_identity(q2k), nonfinite,
                         (tensor_identity(k), tensor_identity(v))) if plan.enabled else None)
    return _forward_result(out, lse, unions, emit, return_unions)


def _mass_strides(mass: torch.Tensor, emit: bool) -> dict:
    """(KV-head, token) strides of the block-mass output, 0 when it is not written."""
    return {"stride_mg": mass.stride(0) if emit else 0, "stride_mt": mass.stride(1) if emit else 0}


def _forward_result(out, lse, unions, emit: dict, return_unions: bool) -> tuple:
    """``(out, lse[, unions][, block_mass])`` as :func:`triton_attention_forward` returns."""
    result = (out, lse) + ((unions,) if return_unions else ())
    return result + ((emit["mass"],) if emit["emit"] else ())
