"""MSA sparse attention backward for SM90 in Triton; deterministic, no atomics.

Two kernels:

* ``dq`` (query-outer, the forward's hybrid schedule): one program per (token, KV head)
  recomputes the probabilities of its ``top_k`` blocks for the ``G`` heads of the group and
  accumulates ``dq = scale * dS K``; tiles of ``dq_union_qt`` tokens whose union of blocks is
  small run a union program instead (M = 128 rows share each K/V read). Either computes
  ``delta = rowsum(dO * O)`` for its rows and stores it for the second kernel.
* ``dk, dv`` (KV-outer): one program per (KV head, key block, key chunk) walks the list of
  query tokens that selected the block (a CSR built with one stable sort, so the list and the
  summation order are fixed) in tiles of ``QT`` tokens x ``G`` heads (M = 64 rows at G = 16) and
  accumulates ``dv += P^T dO`` and ``dk += scale * dS^T Q`` in registers. Every key row belongs
  to exactly one program, so dk/dv are written once, without atomics; the result is bitwise
  reproducible run to run. dq is not added from this kernel (FlashAttention's scheme): on
  Hopper that measured slower on coherent selections and no faster at 8192 tokens, and its
  fp32 sums are not reproducible (ADR 0043); a separate key-major dq kernel adding by fp32
  reductions measured slower than the dq kernels on five of six rows, bound by the rate of
  those reductions (ADR 0044).
  On SM90 at the production shape the same dk/dv comes from the Gluon kernel of
  :mod:`nemo_msa.attention.gluon_dkdv` (ADR 0042), bit for bit. Which of the two runs is the
  caller's ``dkdv`` (a layer's plan names it, ``MSAKernels.dkdv``); only a direct caller without
  one has it chosen per call.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

try:  # Gluon's Hopper API as Triton 3.6 has it; other Tritons take the Triton dk/dv kernel
    from nemo_msa.attention.gluon_dkdv import (
        gluon_dkdv,
        gluon_dkdv_inputs_reason,
        gluon_dkdv_supported,
    )
except ImportError:
    gluon_dkdv = None
from nemo_msa import unplanned
from nemo_msa.attention.triton_union import TileUnions, hybrid_plan, tensor_identity
from nemo_msa.backends.capabilities import GLUON_DKDV
from nemo_msa.triton.guards import (
    dq_tile_masked,
    finite_delta,
    nonfinite_row_counts,
    union_rows_finite,
)
from nemo_msa.triton.kernel_layout import (
    INTERPRET,
    KernelLayout,
    block_query_csr,
    check_attention_inputs,
    check_block_size,
    check_kernel_devices,
    kernel_layout,
    query_subset,
    subset_pointers,
)
from nemo_msa.triton.launch import BackwardLaunch, current_launch
from nemo_msa.triton.tiles import (
    LOG2E,
    LOG2E_C,
    csr_entry_rows,
    doc_block,
    dq_tile,
    dq_tile_rows,
    kv_descriptors,
    load_dq_rows,
    load_kv_tile,
    load_masked_union_tile,
    load_rows,
    load_selection_rows,
    load_whole_kv_tile,
    next_pow2,
    rows_selecting,
    subset_rows,
    subset_tile_tokens_left,
    subset_union_tile_skipped,
    token_rows,
    union_full_blocks,
    union_tile_rows,
)


@triton.jit
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, dq_ptr, q2k_ptr,
    tok_start_ptr, tok_pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_ot, stride_oh, stride_dqt, stride_dqh,
    stride_sg, stride_st, stride_lh,
    scale, scale_log2, count_ptr, block_doc_ptr, block_local_ptr, cu_ptr,
    num_tiles, max_count, tiles_ptr, qrow_ptr,
    TOPK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr,
    HYBRID: tl.constexpr, QT: tl.constexpr, TPP: tl.constexpr, SUBSET: tl.constexpr,
):
    """Per-token dq: the grids of the per-token forward (one program per token, or with
    HYBRID one per ``TPP`` union tiles doing the tokens the union kernel left); SUBSET as in
    the forward (local queries, tiles from a list)."""
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
                        _dq_token(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr,
                                  dq_ptr, q2k_ptr, lt, g, start, p0 + i, stride_qt, stride_qh,
                                  stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
                                  stride_doh, stride_ot, stride_oh, stride_dqt, stride_dqh,
                                  stride_sg, stride_st, stride_lh, scale, scale_log2,
                                  TOPK, G, GP, BS, BN, D, FP32_DOT)
                else:
                    _dq_token(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, dq_ptr,
                              q2k_ptr, start + p0 + i, g, start, p0 + i,
                              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_dot, stride_doh, stride_ot, stride_oh, stride_dqt,
                              stride_dqh, stride_sg, stride_st, stride_lh, scale, scale_log2,
                              TOPK, G, GP, BS, BN, D, FP32_DOT)
    else:
        t = tl.program_id(0)
        _dq_token(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, dq_ptr, q2k_ptr,
                  t, g, tl.load(tok_start_ptr + t), tl.load(tok_pos_ptr + t),
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_dot, stride_doh, stride_ot, stride_oh, stride_dqt, stride_dqh,
                  stride_sg, stride_st, stride_lh, scale, scale_log2,
                  TOPK, G, GP, BS, BN, D, FP32_DOT)


@triton.jit
def _dq_token(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, dq_ptr, q2k_ptr,
              t, g, start, p,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
              stride_dot, stride_doh, stride_ot, stride_oh, stride_dqt, stride_dqh,
              stride_sg, stride_st, stride_lh, scale, scale_log2,
              TOPK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr,
              BN: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr):
    """dq and delta of token ``t`` (document position ``p``, document start ``start``) x the
    G heads of KV head ``g``."""
    t64 = t.to(tl.int64)
    rows = tl.arange(0, GP)
    hmask = rows < G
    heads = g * G + rows
    dd = tl.arange(0, D)
    q, do, delta, lse2 = load_dq_rows(q_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr,
                                      token_rows(t64, heads), heads, hmask, stride_qt, stride_qh,
                                      stride_dot, stride_doh, stride_ot, stride_oh, stride_lh,
                                      D, FP32_DOT)
    dq = tl.zeros((GP, D), tl.float32)
    kn = tl.arange(0, BN)
    for s in range(TOPK):
        b = tl.load(q2k_ptr + g * stride_sg + t64 * stride_st + s)
        for c in tl.static_range(0, BS, BN):
            j = b * BS + c + kn
            kmask = (j <= p) & (b >= 0)
            k, v = load_kv_tile(k_ptr, v_ptr, (start + j).to(tl.int64), kmask, g, stride_kt,
                                stride_kh, stride_vt, stride_vh, D, FP32_DOT)
            dq += dq_tile(q, do, k, v, kmask[None, :] & hmask[:, None], lse2, delta,
                          scale_log2)
    dq = dq * scale
    tl.store(dq_ptr + t64 * stride_dqt + heads[:, None] * stride_dqh + dd[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _dq_union_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, do_ptr, o_ptr, lse_ptr, delta_ptr, dq_ptr, q2k_ptr,
    union_ptr, count_ptr, cu_ptr, block_doc_ptr, block_local_ptr, num_tiles,
    max_count, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_ot, stride_oh, stride_dqt, stride_dqh,
    stride_sg, stride_st, stride_lh, stride_ug, stride_ut,
    scale, scale_log2, tiles_ptr, qrow_ptr, nonfinite_ptr, stride_ng,
    TOPK: tl.constexpr, KP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    QT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    FP32_DOT: tl.constexpr, TMA: tl.constexpr, UW: tl.constexpr, SUBSET: tl.constexpr,
    GUARD: tl.constexpr,
):
    """dq of QT tokens of one document block x G heads in one pass over the union of their
    selected blocks (the forward's union tile); a row only sees blocks its token selected.
    As in the forward's union kernel, the whole blocks come first, without a per-score mask
    (read by TMA when TMA is set); launched twice, without and with the NaN/Inf GUARD, as the
    forward's union kernel (ADR 0032).
    Unlike the forward, a whole block's key tiles are unrolled in one step and the own block
    is read by pointer loads: with its Q and dO tiles two dq programs do not fit an SM, and
    the forward's flat loop and own-block TMA made dq slower at one program per SM.
    SUBSET as in the forward's union kernel."""
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
    urow = union_ptr + g * stride_ug + slot * stride_ut
    full = union_full_blocks(urow, count, own, UW)
    # Before any row load (and delta's store): half of the two launches' programs exit here.
    if union_rows_finite(nonfinite_ptr, g, stride_ng, urow, count, start, length, BS,
                         UW) == GUARD:
        return  # the other launch's program (ADR 0032)
    tok, rmask = subset_rows(tok, rmask, qrow_ptr, SUBSET)
    dd = tl.arange(0, D)
    q, do, delta, lse2 = load_dq_rows(q_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, tok, heads,
                                      rmask, stride_qt, stride_qh, stride_dot, stride_doh,
                                      stride_ot, stride_oh, stride_lh, D, FP32_DOT)
    selection = load_selection_rows(q2k_ptr, g, tok, rmask, stride_sg, stride_st, TOPK, KP)
    dq = tl.zeros((BM, D), tl.float32)
    kn = tl.arange(0, BN)
    dq = _dq_whole_blocks(q, do, lse2, delta, dq, k_ptr, v_ptr, k_desc, v_desc, urow, full,
                          selection, rmask, start, g, stride_kt, stride_kh, stride_vt,
                          stride_vh, scale_log2, BS, BN, D, FP32_DOT, TMA, GUARD)
    for u in range(full, count):
        b = tl.load(urow + u)
        sel = rows_selecting(selection, b) & rmask
        for c in tl.static_range(0, BS, BN):
            k, v, vis = load_masked_union_tile(k_ptr, v_ptr, b * BS + c + kn, start, length,
                                               pos, sel, g, stride_kt, stride_kh, stride_vt,
                                               stride_vh, D, FP32_DOT)
            if GUARD:
                dq += dq_tile_masked(q, do, k, v, vis, lse2, delta, scale_log2)
            else:
                dq += dq_tile(q, do, k, v, vis, lse2, delta, scale_log2)
    dq = dq * scale
    tl.store(dq_ptr + tok[:, None] * stride_dqt + heads[:, None] * stride_dqh + dd[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _dq_whole_blocks(q, do, lse2, delta, dq, k_ptr, v_ptr, k_desc, v_desc, urow, full,
                     selection, rmask, start, g, stride_kt, stride_kh, stride_vt, stride_vh,
                     scale_log2, BS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                     FP32_DOT: tl.constexpr, TMA: tl.constexpr, GUARD: tl.constexpr):
    """dq of the union kernel's first ``full`` entries (whole blocks) added to ``dq``. Rows
    that did not select a block have probability 0 there; with GUARD they also keep their sum
    by a select (0 * NaN where the tile holds a NaN/Inf, ADR 0025), without it the tiles must
    be finite (ADR 0032)."""
    for u in range(full):
        b = tl.load(urow + u)
        sel = rows_selecting(selection, b) & rmask
        for c in tl.static_range(0, BS, BN):
            k, v = load_whole_kv_tile(k_ptr, v_ptr, k_desc, v_desc, start + b * BS + c, g,
                                      stride_kt, stride_kh, stride_vt, stride_vh, BN, D,
                                      FP32_DOT, TMA)
            if GUARD:
                dq = tl.where(sel[:, None], dq + dq_tile_rows(q, do, k, v, sel, lse2, delta,
                                                               scale_log2), dq)
            else:
                dq += dq_tile_rows(q, do, k, v, sel, lse2, delta, scale_log2)
    return dq


@triton.jit
def _dkdv_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, tok, heads, rmask, stride_qt, stride_qh,
               stride_dot, stride_doh, stride_lh, D: tl.constexpr, FP32_DOT: tl.constexpr):
    """One step's rows for dk/dv: q, dO [M, D], LSE (log2 domain) and delta fp32 [M]."""
    q = load_rows(q_ptr, tok, heads, rmask, stride_qt, stride_qh, D)
    do = load_rows(do_ptr, tok, heads, rmask, stride_dot, stride_doh, D)
    lse2 = tl.load(lse_ptr + heads * stride_lh + tok, mask=rmask, other=0.0) * LOG2E_C
    delta = tl.load(delta_ptr + heads * stride_lh + tok, mask=rmask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2, delta = finite_delta(lse2, delta)
    return q, do, lse2, delta


@triton.jit
def _dkdv_accumulate(q, do, v, pr, delta, dk, dv):
    """Adds one step's P^T dO to dv and dS^T Q to dk (dS = P (dP - delta))."""
    dp = tl.dot(do, tl.trans(v))
    ds = pr * (dp - delta[:, None])
    dv += tl.dot(tl.trans(pr.to(do.dtype)), do)
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    offsets_ptr, list_ptr, order_ptr, block_doc_ptr, block_local_ptr, cu_ptr, tok_pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    num_blocks_bound, scale, scale_log2,
    G: tl.constexpr, GP: tl.constexpr, QT: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr,
):
    CHUNKS: tl.constexpr = BS // BN
    BM: tl.constexpr = QT * GP
    seg = tl.load(order_ptr + tl.program_id(0) // CHUNKS)
    c = tl.program_id(0) % CHUNKS
    g = seg // num_blocks_bound
    blk = seg % num_blocks_bound
    doc, b, start, length = doc_block(blk, block_doc_ptr, block_local_ptr, cu_ptr)
    if doc < 0:
        return
    kn = tl.arange(0, BN)
    j = b * BS + c * BN + kn
    kvalid = j < length
    rows_k = (start + j).to(tl.int64)
    dd = tl.arange(0, D)
    k, v = load_kv_tile(k_ptr, v_ptr, rows_k, kvalid, g, stride_kt, stride_kh, stride_vt,
                        stride_vh, D, FP32_DOT)
    dk = tl.zeros((BN, D), tl.float32)
    dv = tl.zeros((BN, D), tl.float32)
    lo = tl.load(offsets_ptr + seg)
    hi = tl.load(offsets_ptr + seg + 1)
    r = tl.arange(0, BM)
    r_tok = r // GP
    r_head = r % GP
    heads = g * G + r_head
    for e in range(lo, hi, QT):
        _, rmask, tok, pos = csr_entry_rows(list_ptr, tok_pos_ptr, e, hi, r_tok, r_head, G)
        q, do, lse2, delta = _dkdv_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, tok, heads, rmask,
                                        stride_qt, stride_qh, stride_dot, stride_doh, stride_lh,
                                        D, FP32_DOT)
        vis = (j[None, :] <= pos[:, None]) & rmask[:, None]
        sc = tl.dot(q, tl.trans(k)) * scale_log2
        pr = tl.where(vis, tl.exp2(sc - lse2[:, None]), 0.0)
        dk, dv = _dkdv_accumulate(q, do, v, pr, delta, dk, dv)
    dk = dk * scale
    tl.store(dk_ptr + rows_k[:, None] * stride_dkt + g * stride_dkh + dd[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=kvalid[:, None])
    tl.store(dv_ptr + rows_k[:, None] * stride_dvt + g * stride_dvh + dd[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=kvalid[:, None])


def dkdv_launch(cfg: BackwardLaunch, group: int, block_size: int, head_dim: int) -> dict:
    """The dk/dv kernel's tile constexprs (``GP``, ``QT``, ``BN``) and launch options
    (``num_warps``, ``num_stages``) under ``cfg`` for ``group`` query heads per KV head: what the
    launcher passes, and what ``benchmarks/kernel_report.py`` compiles."""
    gp = max(16, next_pow2(group))
    return dict(GP=gp, QT=max(1, cfg.kv_rows // gp), BN=min(block_size, cfg.kv_bn),
                num_warps=cfg.kv_warps if head_dim == 128 else 4, num_stages=cfg.kv_stages)


def _launch_dq(cfg: BackwardLaunch, view: KernelLayout, rows: dict, q2k_, scale, t, hkv, top_k,
               grp, gp, d, unions, subset=None):
    """dq and delta: the union kernel for tiles with a small union, per token for the rest
    (with the forward's union lists when ``unions`` holds them for dq's tile size).
    ``rows``: the q, k, v, dO, O, lse, delta and dq tensors by kernel argument name;
    ``subset``: the query subset (``QuerySubset``) or None."""
    bs = view.block_size
    k_, v_ = rows["k_ptr"], rows["v_ptr"]
    args = dict(rows, q2k_ptr=q2k_, **_row_strides(rows), stride_sg=q2k_.stride(0),
                stride_st=q2k_.stride(1), scale=scale, scale_log2=scale * LOG2E,
                block_doc_ptr=view.block_doc, block_local_ptr=view.block_local,
                cu_ptr=view.cu_seqlens, TOPK=top_k, G=grp, GP=gp, BS=bs, D=d,
                FP32_DOT=INTERPRET, SUBSET=subset is not None)
    plan = hybrid_plan(q2k_, view, cfg.dq_union_qt, cfg.dq_union_max, gp, rows["delta_ptr"],
                       build_tiles=cfg.dq_union_build_tiles,
                       build_warps=cfg.dq_union_build_warps, unions=unions, subset=subset)
    args.update(count_ptr=plan.count, num_tiles=plan.num_tiles, max_count=plan.max_count,
                **subset_pointers(subset, plan.qt, view))
    if plan.enabled:
        ubn = min(bs, cfg.dq_union_bn) if d == 128 else bs
        descs = kv_descriptors(k_, v_, ubn, INTERPRET) if cfg.dq_union_tma else None
        k_desc, v_desc = descs or (k_, v_)
        nonfinite = _forward_nonfinite(unions, rows)
        if nonfinite is None:
            nonfinite = nonfinite_row_counts(k_, v_)
        for guard in (False, True):
            _dq_union_kernel[(plan.num_tiles, hkv)](
                **args, k_desc=k_desc, v_desc=v_desc, union_ptr=plan.union,
                nonfinite_ptr=nonfinite, stride_ng=nonfinite.stride(0),
                stride_ug=plan.union.stride(0), stride_ut=plan.union.stride(1),
                KP=next_pow2(top_k), QT=plan.qt, BN=ubn,
                TMA=descs is not None, UW=next_pow2(plan.union.shape[2]), GUARD=guard,
                num_warps=cfg.dq_union_warps, num_stages=cfg.dq_union_stages,
            )
    tpp = cfg.dq_tile_grid_tiles if plan.enabled else 1
    _dq_kernel[(triton.cdiv(plan.num_tiles, tpp) if plan.enabled else t, hkv)](
        **args, tok_start_ptr=(subset or view).token_start,
        tok_pos_ptr=(subset or view).token_pos, BN=min(bs, cfg.dq_bn) if d == 128 else bs,
        HYBRID=plan.enabled, QT=max(plan.qt, 1), TPP=tpp,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages,
    )


def _forward_nonfinite(unions: TileUnions | None, rows: dict) -> torch.Tensor | None:
    """The forward's NaN/Inf row counts when ``unions`` carries them for the k and v of
    ``rows`` (``k_ptr`` / ``v_ptr``), else None (then dq counts them itself)."""
    if unions is None or unions.nonfinite is None:
        return None
    kv = (tensor_identity(rows["k_ptr"]), tensor_identity(rows["v_ptr"]))
    return unions.nonfinite if unions.kv_source == kv else None


#: The row strides each kernel takes, by the tensor argument they belong to.
_STRIDES = {"q_ptr": ("stride_qt", "stride_qh"), "k_ptr": ("stride_kt", "stride_kh"),
            "v_ptr": ("stride_vt", "stride_vh"), "do_ptr": ("stride_dot", "stride_doh"),
            "o_ptr": ("stride_ot", "stride_oh"), "dq_ptr": ("stride_dqt", "stride_dqh"),
            "dk_ptr": ("stride_dkt", "stride_dkh"), "dv_ptr": ("stride_dvt", "stride_dvh")}


def _row_strides(rows: dict) -> dict:
    """The (token, head) strides of the [T, heads, d] tensors in ``rows``, and the head stride
    ``stride_lh`` of lse / delta, as kernel keyword arguments."""
    out = {"stride_lh": rows["lse_ptr"].stride(0)}
    for name, (st, sh) in _STRIDES.items():
        if name in rows:
            out[st], out[sh] = rows[name].stride(0), rows[name].stride(1)
    return out


def triton_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              q2k: torch.Tensor, msa, softmax_scale: float | None = None, *,
                              block_size: int | None = None, unions: TileUnions | None = None,
                              launch: BackwardLaunch | None = None,
                              queries: torch.Tensor | None = None, dkdv: str | None = None):
    """Gradients of the sparse MSA attention; deterministic (no atomics).

    Args:
        dout: [T, Hq, d] gradient of the output, q's dtype.
        q: bf16/fp16 [T, Hq, d] queries.
        k: same dtype [T, Hkv, d] keys.
        v: same dtype [T, Hkv, d] values.
        out: [T, Hq, d] forward output, q's dtype.
        lse: fp32 [Hq, T] forward natural log-sum-exp.
        q2k: int32 [Hkv, T, top_k] selected document-local block ids, -1 = none.
        msa: the microbatch layout (see :func:`triton_attention_forward`).
        softmax_scale: the forward's scale; ``1 / sqrt(d)`` when None.
        block_size: key block size; defaults to ``msa.block_size``.
        unions: the forward's union lists of this q2k (``return_unions=True``); dq uses them
            instead of building its own when its tile size is theirs. None: dq builds them.
        launch: launch parameters; None takes
            :func:`~nemo_msa.triton.launch.current_launch` ``("bwd")``.
        queries: int64 [Tq] global compact rows of the local queries, or None (see
            :func:`~nemo_msa.attention.triton_fwd.triton_attention_forward`): dout, q, out, lse
            and q2k then have Tq rows; dk / dv have k's T rows and hold the local queries'
            contributions only (the CP reduce-scatter adds the ranks').
        dkdv: the dk/dv kernel, ``"triton"`` or ``"gluon"`` (a layer's plan names it:
            ``MSAKernels.dkdv``); None chooses per call from the inputs and ``launch``'s
            ``kv_kernel`` (a direct caller; counted by :mod:`nemo_msa.unplanned`).

    Returns:
        ``(dq, dk, dv)`` with q's, k's and v's shapes and dtypes.

    Raises:
        ValueError: on a bad argument (the message names it, its value and the expectation),
            or ``dkdv="gluon"`` on inputs the Gluon kernel does not take (naming
            ``MSAKernels.dkdv``).
    """
    cfg = current_launch("bwd") if launch is None else launch
    bs = int(block_size if block_size is not None else msa.block_size)
    check_block_size(bs)
    view = kernel_layout(msa, bs)
    subset = query_subset(msa, bs, queries)
    t, hq, hkv, d, grp, top_k = check_attention_inputs(q, k, v, q2k, view, subset)
    for name, x in (("dout", dout), ("out", out)):
        if x.shape != q.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} must equal q's {tuple(q.shape)}")
    if lse.shape != (hq, t) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be fp32 [Hq={hq}, T={t}], got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    check_kernel_devices(view, dout=dout, out=out, lse=lse)
    if unions is not None and unions.source != tensor_identity(q2k):
        raise ValueError(f"unions were built from another q2k (data_ptr, version, shape) = "
                         f"{unions.source}, got {tensor_identity(q2k)}: pass the forward's "
                         f"unions with the q2k it was given, unchanged")
    if dkdv not in (None, "triton", "gluon"):
        raise ValueError(f"dkdv={dkdv!r}; expected 'triton', 'gluon' or None")
    if dkdv == "gluon":  # before any kernel runs
        _check_gluon_call(q, grp, bs)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k) if subset is None else torch.zeros_like(k)
    dv = torch.empty_like(v) if subset is None else torch.zeros_like(v)
    if t == 0:
        return dq, dk, dv
    q_, k_, v_, do_, o_ = (x if x.stride(-1) == 1 else x.contiguous()
                           for x in (q, k, v, dout, out))
    lse_ = lse.contiguous()
    q2k_ = q2k.contiguous()
    delta = torch.empty_like(lse_)
    gp = max(16, next_pow2(grp))
    rows = dict(q_ptr=q_, k_ptr=k_, v_ptr=v_, do_ptr=do_, o_ptr=o_, lse_ptr=lse_,
                delta_ptr=delta, dq_ptr=dq)
    # The dq launch also writes delta (rowsum(dO * O)), which the dk/dv kernel reads.
    _launch_dq(cfg, view, rows, q2k_, scale, t, hkv, top_k, grp, gp, d, unions, subset)
    csr = block_query_csr(q2k_, view, subset)
    if dkdv is None:
        unplanned.record("dkdv")
        dkdv = ("gluon" if cfg.kv_kernel == "gluon" and gluon_dkdv is not None
                and gluon_dkdv_supported(q_, k_, v_, do_, grp, bs) else "triton")
    if dkdv == "gluon":
        gluon_dkdv(*_gluon_inputs(q_, k_, v_, do_), lse_, delta, csr, view,
                   (subset or view).token_pos, scale, bs, dk, dv)
        return dq, dk, dv
    meta = dkdv_launch(cfg, grp, bs, d)
    rows = dict(q_ptr=q_, k_ptr=k_, v_ptr=v_, do_ptr=do_, lse_ptr=lse_, delta_ptr=delta,
                dk_ptr=dk, dv_ptr=dv)
    _dkdv_kernel[(hkv * view.num_blocks_bound * (bs // meta["BN"]),)](
        **rows, **_row_strides(rows), offsets_ptr=csr.offsets, list_ptr=csr.tokens,
        order_ptr=csr.order, block_doc_ptr=view.block_doc, block_local_ptr=view.block_local,
        cu_ptr=view.cu_seqlens, tok_pos_ptr=(subset or view).token_pos,
        num_blocks_bound=view.num_blocks_bound, scale=scale, scale_log2=scale * LOG2E,
        G=grp, BS=bs, D=d, FP32_DOT=INTERPRET, **meta,
    )
    return dq, dk, dv


def _check_gluon_call(q: torch.Tensor, group: int, block_size: int) -> None:
    """Refuses a call the Gluon dk/dv kernel, named by the caller's plan, does not take.

    Raises:
        ValueError: the Gluon kernel is not importable here, or the call is not what it takes
            (naming ``MSAKernels.dkdv``).
    """
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    reason = GLUON_DKDV.why_not(compute_capability=capability, dtype=q.dtype,
                                head_dim=q.shape[-1], block_size=block_size, group=group,
                                triton_version=triton.__version__)
    if reason is None and gluon_dkdv is None:
        reason = "nemo_msa.attention.gluon_dkdv does not import with this Triton"
    if reason is not None:
        raise ValueError(f"MSAKernels.dkdv='gluon' but this call has {reason}; the layer's "
                         "plan did not foresee it")


def _gluon_inputs(q, k, v, dout) -> tuple[torch.Tensor, ...]:
    """q, k, v and dO laid out as the Gluon kernel reads them (dense copies of those that are
    not), for a caller whose plan named it.

    Raises:
        ValueError: more rows than its int32 coordinates reach (naming ``MSAKernels.dkdv``).
    """
    if gluon_dkdv_inputs_reason(q, k, v, dout) is not None:
        q, k, v, dout = (x.clone(memory_format=torch.contiguous_format) for x in (q, k, v, dout))
    reason = gluon_dkdv_inputs_reason(q, k, v, dout)
    if reason is not None:
        raise ValueError(f"MSAKernels.dkdv='gluon': this call's {reason}, which the layer's "
                         "plan did not foresee; build it with bwd.kv_kernel='triton'")
    return q, k, v, dout
