"""The dense indexer loss (score ``"max"``) fused in Triton: the dense warm-up's and
``msa_indexer_loss_type="dense"``'s KL over every candidate block, with no [T, T] tensor.

Forward, one program per (16 consecutive tokens of one document block, KV group g), its rows the
tokens x the group's query heads (GQA packing):

1. a pass over the visible key blocks computes each row's dense log-sum-exp (Q K^T only);
2. a second pass computes each block's softmax mass with that lse, sums it over the group's query
   heads (the target ``P_g(t, b)``), scores the block with the index head (block max of
   index_q . index_k and its argmax key) and folds both into the KL online:
   ``KL = sum_b P_b log P_b - sum_b P_b s_b + (sum_b P_b) logsumexp_b s_b``.

It stores, per (g, token, document-local block), the target and the argmax key (fp32 / int32
[G, T, nb], nb the longest document's block count: O(T x H x blocks), the only memory beyond the
inputs), and per (g, token) the KL, the prediction's log-normalizer and the target's sum.

Backward, with no recompute of either attention: ``d KL / d s_b = Q_b sum(P) - P_b`` from the
stored target, the argmax key's score (one d-long dot) and the normalizer;
d index_q gathers the argmax keys (one program per 64 tokens), d index_k sums, per key block, a
one-hot [block, tokens] x index_q product over the queries that see the block (one program per
(block, head), partial sums per head added after: deterministic, no atomics). The one-hot operand
is split into two bf16 halves (hi + lo) so the tensor-core product keeps ~2^-16 of fp32.

:func:`nemo_msa.indexer_loss.naive.compute_indexer_loss` (``sparse=False``) is the reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nemo_msa.backends.capabilities import TRITON
from nemo_msa.triton.kernel_layout import (
    INTERPRET,
    check_kernel_devices,
    kernel_layout,
    query_subset,
    subset_pointers,
)
from nemo_msa.triton.tiles import LOG2E, subset_rows, subset_tile, union_tile_span

__all__ = ["dense_indexer_loss_triton"]

# Tokens per forward program: one index-side MMA needs 16 rows.
_QT = 16
# Rows per forward program at most (tokens x padded group heads): the S tile's registers.
_MAX_ROWS = 256
# Tokens per d index_q program and per d index_k loop step.
_BT_DQ = 64
_BT_DK = 64


# The record the plan reads states the group limit; it is this kernel's tile (asserted so that
# the two cannot drift apart).
assert TRITON.fused_dense_loss_max_group == _MAX_ROWS // _QT


def _unsupported_reason(query, key, index_q, block_size: int) -> str | None:
    """Why the fused dense loss cannot run these inputs (None when it can): the record's limits
    (:meth:`~nemo_msa.backends.capabilities.MSACapabilities.why_not_fused_dense_loss`) and the
    inputs' agreement."""
    if index_q.dtype != query.dtype:
        return f"index_q dtype {index_q.dtype} differs from query dtype {query.dtype}"
    if index_q.shape[1] != key.shape[1]:
        return f"index heads {index_q.shape[1]} != KV heads {key.shape[1]}"
    return TRITON.why_not_fused_dense_loss(
        dtype=query.dtype, head_dim=query.shape[-1], index_head_dim=index_q.shape[-1],
        block_size=block_size, group=query.shape[1] // key.shape[1], score_type="max")


@triton.jit
def _dense_kl_fwd_kernel(
    q_ptr, k_ptr, iq_ptr, ik_ptr, block_doc_ptr, block_local_ptr, cu_ptr,
    target_ptr, argkey_ptr, kl_ptr, lse_ptr, tsum_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_iqt, stride_iqh, stride_ikt,
    stride_pg, stride_pt, stride_sg,
    qk_scale, index_scale, tiles_ptr, qrow_ptr,
    HG: tl.constexpr, HGP: tl.constexpr, QT: tl.constexpr, BS: tl.constexpr,
    D: tl.constexpr, DI: tl.constexpr, FP32_DOT: tl.constexpr, SUBSET: tl.constexpr,
):
    # With SUBSET (ADR 0021) the tile comes from the list of tiles holding a local query and
    # the query side (query, index_q and every output) is read and written at local rows.
    tile = subset_tile(tl.program_id(0), tiles_ptr, SUBSET)
    g = tl.program_id(1)
    doc, start, length, p0 = union_tile_span(tile, block_doc_ptr, block_local_ptr, cu_ptr, QT, BS)
    if doc < 0 or p0 >= length:
        return
    M: tl.constexpr = QT * HGP
    rows = tl.arange(0, M)
    head = rows % HGP
    pos = p0 + rows // HGP  # document position of each row's token
    row_ok = (head < HG) & (pos < length)
    qrow, row_ok = subset_rows(start + pos, row_ok, qrow_ptr, SUBSET)
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + qrow[:, None] * stride_qt
                + (g * HG + head)[:, None] * stride_qh + dd[None, :],
                mask=row_ok[:, None], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    tq = tl.arange(0, QT)
    tpos = p0 + tq
    tok_ok = tpos < length
    trow, tok_ok = subset_rows(start + tpos, tok_ok, qrow_ptr, SUBSET)
    de = tl.arange(0, DI)
    iq = tl.load(iq_ptr + trow[:, None] * stride_iqt + g * stride_iqh + de[None, :],
                 mask=tok_ok[:, None], other=0.0)
    if FP32_DOT:
        iq = iq.to(tl.float32)
    own = p0 // BS
    cols = tl.arange(0, BS)

    # Pass 1: every row's dense log-sum-exp (log2 domain) over its visible keys.
    m = tl.full([M], -float("inf"), tl.float32)
    lsum = tl.zeros([M], tl.float32)
    for j in range(0, own + 1):
        kpos = j * BS + cols
        k_ok = kpos < length
        k = tl.load(k_ptr + (start + kpos)[:, None].to(tl.int64) * stride_kt + g * stride_kh
                    + dd[None, :], mask=k_ok[:, None], other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(k_ok[None, :] & (kpos[None, :] <= pos[:, None]), s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        lsum = lsum * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    lse2 = m + tl.log2(lsum)

    # Pass 2: per block the target mass and the index score, folded into the KL online.
    inv_group = 1.0 / HG
    ent = tl.zeros([QT], tl.float32)  # sum_b P log P
    cross = tl.zeros([QT], tl.float32)  # sum_b P s_b
    tsum = tl.zeros([QT], tl.float32)  # sum_b P
    mi = tl.full([QT], -float("inf"), tl.float32)
    li = tl.zeros([QT], tl.float32)
    out_off = g * stride_pg + trow * stride_pt
    for j in range(0, own + 1):
        kpos = j * BS + cols
        k_ok = kpos < length
        krow = (start + kpos).to(tl.int64)
        k = tl.load(k_ptr + krow[:, None] * stride_kt + g * stride_kh + dd[None, :],
                    mask=k_ok[:, None], other=0.0)
        ik = tl.load(ik_ptr + krow[:, None] * stride_ikt + de[None, :], mask=k_ok[:, None],
                     other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
            ik = ik.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(k_ok[None, :] & (kpos[None, :] <= pos[:, None]), s, -float("inf"))
        p = tl.exp2(s - lse2[:, None])
        row_mass = tl.where(head < HG, tl.sum(p, axis=1), 0.0)
        mass = tl.sum(tl.reshape(row_mass, (QT, HGP)), axis=1) * inv_group
        si = tl.dot(iq, tl.trans(ik))
        si = tl.where(k_ok[None, :] & (kpos[None, :] <= tpos[:, None]), si, -float("inf"))
        best = tl.max(si, axis=1)
        arg = tl.argmax(si, axis=1)
        sb = best * index_scale
        mi_new = tl.maximum(mi, sb)
        li = li * tl.exp(mi - mi_new) + tl.exp(sb - mi_new)
        mi = mi_new
        ent += tl.where(mass > 0, mass * tl.log(tl.maximum(mass, 1e-30)), 0.0)
        cross += mass * sb
        tsum += mass
        tl.store(target_ptr + out_off + j, mass, mask=tok_ok)
        tl.store(argkey_ptr + out_off + j, (start + j * BS + arg).to(tl.int32), mask=tok_ok)
    lse_i = mi + tl.log(li)
    stat = g * stride_sg + trow
    tl.store(kl_ptr + stat, ent - cross + tsum * lse_i, mask=tok_ok)
    tl.store(lse_ptr + stat, lse_i, mask=tok_ok)
    tl.store(tsum_ptr + stat, tsum, mask=tok_ok)


@triton.jit
def _dense_kl_dq_kernel(
    iq_ptr, ik_ptr, pos_ptr, target_ptr, argkey_ptr, lse_ptr, tsum_ptr, grad_ptr, dq_ptr,
    T, stride_iqt, stride_iqh, stride_ikt, stride_pg, stride_pt, stride_sg,
    index_scale, inv_denominator,
    BS: tl.constexpr, BT: tl.constexpr, DI: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    t = pid * BT + tl.arange(0, BT)
    ok = t < T
    t64 = t.to(tl.int64)
    de = tl.arange(0, DI)
    own = tl.load(pos_ptr + t, mask=ok, other=0) // BS
    iq = tl.load(iq_ptr + t64[:, None] * stride_iqt + g * stride_iqh + de[None, :],
                 mask=ok[:, None], other=0.0).to(tl.float32)
    stat = g * stride_sg + t64
    lse_i = tl.load(lse_ptr + stat, mask=ok, other=0.0)
    tsum = tl.load(tsum_ptr + stat, mask=ok, other=0.0)
    coef = tl.load(grad_ptr).to(tl.float32) * index_scale * inv_denominator
    acc = tl.zeros([BT, DI], tl.float32)
    off = g * stride_pg + t64 * stride_pt
    for j in range(0, tl.max(own, axis=0) + 1):
        live = ok & (j <= own)
        key = tl.load(argkey_ptr + off + j, mask=live, other=0).to(tl.int64)
        mass = tl.load(target_ptr + off + j, mask=live, other=0.0)
        ik = tl.load(ik_ptr + key[:, None] * stride_ikt + de[None, :], mask=live[:, None],
                     other=0.0).to(tl.float32)
        score = tl.sum(iq * ik, axis=1) * index_scale
        ds = tl.where(live, (tl.exp(score - lse_i) * tsum - mass) * coef, 0.0)
        acc += ds[:, None] * ik
        # The target is read for the last time here: its slot keeps d score for d index_k.
        tl.store(target_ptr + off + j, ds, mask=live)
    tl.store(dq_ptr + t64[:, None] * stride_iqt + g * stride_iqh + de[None, :], acc,
             mask=ok[:, None])


@triton.jit
def _dk_step(iq_ptr, dscore_ptr, argkey_ptr, trow, ok, krow, local, g, stride_iqt, stride_iqh,
             stride_pg, stride_pt, BT: tl.constexpr, DI: tl.constexpr, FP32_DOT: tl.constexpr):
    """One step of d index_k for a key block (rows ``krow``): the one-hot [block, BT] x
    index_q product over the query rows ``trow`` (``ok`` the real ones), fp32 [block, DI]."""
    de = tl.arange(0, DI)
    off = g * stride_pg + trow * stride_pt + local
    key = tl.load(argkey_ptr + off, mask=ok, other=-1).to(tl.int64)
    ds = tl.load(dscore_ptr + off, mask=ok, other=0.0)
    iq = tl.load(iq_ptr + trow[:, None] * stride_iqt + g * stride_iqh + de[None, :],
                 mask=ok[:, None], other=0.0)
    onehot = tl.where(krow[:, None] == key[None, :], ds[None, :], 0.0)  # [BS, BT]
    if FP32_DOT:
        step = tl.dot(onehot, iq.to(tl.float32))
    else:
        hi = onehot.to(iq.dtype)
        lo = (onehot - hi.to(tl.float32)).to(iq.dtype)
        step = tl.dot(hi, iq) + tl.dot(lo, iq)
    return step


@triton.jit
def _dense_kl_dk_kernel(
    iq_ptr, block_doc_ptr, block_local_ptr, cu_ptr, dscore_ptr, argkey_ptr, dk_ptr,
    stride_iqt, stride_iqh, stride_pg, stride_pt, stride_dkg, stride_dkt, qrow_ptr,
    BS: tl.constexpr, BT: tl.constexpr, DI: tl.constexpr, FP32_DOT: tl.constexpr,
    SUBSET: tl.constexpr,
):
    # With SUBSET only the document's local queries (``query_row``) add to the block's keys,
    # and the steps holding none of them are skipped.
    blk = tl.program_id(0)
    g = tl.program_id(1)
    doc = tl.load(block_doc_ptr + blk)
    if doc < 0:
        return
    local = tl.load(block_local_ptr + blk)
    start = tl.load(cu_ptr + doc)
    length = tl.load(cu_ptr + doc + 1) - start
    cols = tl.arange(0, BS)
    kpos = local * BS + cols
    krow = (start + kpos).to(tl.int64)
    acc = tl.zeros([BS, DI], tl.float32)
    for q0 in range(local * BS, length, BT):
        tpos = q0 + tl.arange(0, BT)
        ok = tpos < length
        trow, ok = subset_rows(start + tpos, ok, qrow_ptr, SUBSET)
        if SUBSET:
            if tl.max(ok.to(tl.int32), axis=0) > 0:
                acc += _dk_step(iq_ptr, dscore_ptr, argkey_ptr, trow, ok, krow, local, g,
                                stride_iqt, stride_iqh, stride_pg, stride_pt, BT, DI, FP32_DOT)
        else:
            acc += _dk_step(iq_ptr, dscore_ptr, argkey_ptr, trow, ok, krow, local, g,
                            stride_iqt, stride_iqh, stride_pg, stride_pt, BT, DI, FP32_DOT)
    de = tl.arange(0, DI)
    tl.store(dk_ptr + g * stride_dkg + krow[:, None] * stride_dkt + de[None, :], acc,
             mask=(kpos < length)[:, None])


class _DenseKL(torch.autograd.Function):
    """The summed KL (already computed by the forward kernel) divided by ``denominator``, with
    the gradients of index_q and index_k from the stored target and argmax keys."""

    @staticmethod
    def forward(ctx, index_q, index_k, kl_rows, target, argkey, lse, tsum, blocks, index_scale,
                denominator, subset):
        ctx.save_for_backward(index_q, index_k, target, argkey, lse, tsum)
        ctx.blocks = blocks
        ctx.subset = subset
        ctx.index_scale = index_scale
        ctx.denominator = denominator
        ctx.consumed = False
        return kl_rows.sum() / denominator

    @staticmethod
    def backward(ctx, grad):
        if ctx.consumed:
            raise RuntimeError(
                "the fused dense indexer loss backs up once (its target buffer holds d score "
                "after the first backward); retain_graph=True cannot reuse it"
            )
        ctx.consumed = True
        index_q, index_k, target, argkey, lse, tsum = ctx.saved_tensors
        blocks = ctx.blocks
        # dq is written with index_q's strides, so both must be the same dense layout.
        iq = index_q.detach().contiguous()
        tokens, heads, dim = iq.shape
        block = blocks.block_size
        rows = blocks if ctx.subset is None else ctx.subset
        dq = torch.empty(tokens, heads, dim, dtype=torch.float32, device=iq.device)
        grad = grad.detach().to(torch.float32).reshape(1).contiguous()
        _dense_kl_dq_kernel[(triton.cdiv(tokens, _BT_DQ), heads)](
            iq, index_k, rows.token_pos, target, argkey, lse, tsum, grad, dq,
            tokens, iq.stride(0), iq.stride(1), index_k.stride(0),
            target.stride(0), target.stride(1), lse.stride(0),
            ctx.index_scale, 1.0 / ctx.denominator,
            BS=block, BT=_BT_DQ, DI=dim,
        )
        dk_heads = torch.empty(heads, blocks.num_tokens, dim, dtype=torch.float32,
                               device=iq.device)
        _dense_kl_dk_kernel[(blocks.num_blocks_bound, heads)](
            iq, blocks.block_doc, blocks.block_local, blocks.cu_seqlens, target, argkey,
            dk_heads, iq.stride(0), iq.stride(1), target.stride(0), target.stride(1),
            dk_heads.stride(0), dk_heads.stride(1),
            subset_pointers(ctx.subset, 0, blocks)["qrow_ptr"],
            BS=block, BT=_BT_DK, DI=dim, FP32_DOT=INTERPRET, SUBSET=ctx.subset is not None,
        )
        dk = dk_heads.sum(0)
        return (dq.to(index_q.dtype), dk.to(index_k.dtype), None, None, None, None, None, None,
                None, None, None)


def dense_indexer_loss_triton(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    msa,
    *,
    softmax_scale: float,
    num_index_heads_total: int,
    loss_coeff: float,
    q2k: torch.Tensor | None = None,
    queries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The dense indexer loss, score ``"max"``, in two fused passes and no [T, T] tensor.

    The same function as ``compute_indexer_loss(..., sparse=False, score_type="max")``.

    Args:
        index_q: bf16/fp16 [T, H_local, d_idx] index queries (with gradient), H_local = G.
        index_k: [T, d_idx] the shared index key (with gradient), same dtype.
        query: [T, Hq_local, d] main-attention queries after RoPE (no gradient taken).
        key: [T, G, d] main-attention keys after RoPE (no gradient taken).
        msa: the microbatch layout (``MSAMicrobatch``).
        softmax_scale: the main attention's scale.
        num_index_heads_total: index heads of the whole layer (all TP ranks).
        loss_coeff: msa_indexer_loss_coeff.
        q2k: optional int32 [G, T, top_k] selected blocks: adds the exact selection recall.
        queries: int64 [Tq] global compact rows of the local queries (context parallelism,
            ADR 0021), or None for every token. With it index_q, query and q2k have Tq rows,
            index_k and key the layout's T rows; the KL sums the local queries' rows, still
            divided by the GLOBAL ``T * H`` (so the CP ranks' losses add up to the one-rank
            loss), ``recall_count`` counts the local rows, and d index_k (T rows) holds the
            local queries' contributions.

    Returns:
        ``(loss, stats)`` as ``compute_indexer_loss``: loss = ``coeff * sum_local KL / (T * H)``
        (fp32 scalar); stats ``kl`` and, with q2k, ``recall_mass`` / ``recall_count``.

    Raises:
        ValueError: shapes the kernel does not run (the record
            :data:`nemo_msa.backends.capabilities.TRITON`; the plan checks it at construction),
            or inputs and layout on a device the kernels cannot use.
    """
    reason = _unsupported_reason(query, key, index_q, msa.block_size)
    if reason is not None:
        raise ValueError(f"dense_indexer_loss_triton cannot run {reason}")
    blocks = kernel_layout(msa, msa.block_size)
    subset = query_subset(msa, msa.block_size, queries)
    check_kernel_devices(blocks, index_q=index_q, index_k=index_k, query=query, key=key)
    tokens, heads, index_dim = index_q.shape
    expected = blocks.num_tokens if subset is None else subset.num_queries
    for name, x, rows, what in (("index_q", index_q, expected, "query"),
                                ("query", query, expected, "query"),
                                ("index_k", index_k, blocks.num_tokens, "layout token"),
                                ("key", key, blocks.num_tokens, "layout token")):
        if x.shape[0] != rows:
            raise ValueError(f"{name} has {x.shape[0]} rows: expected {rows}, one per {what}")
    q_heads, head_dim = query.shape[1], query.shape[2]
    group = q_heads // heads
    block = msa.block_size
    width = max(1, -(-int(msa.max_seqlen) // block))
    device = index_q.device
    query = query.detach().contiguous()
    key = key.detach().contiguous()
    iq = index_q.detach().contiguous()
    ik = index_k.detach().contiguous()
    target = torch.empty(heads, tokens, width, dtype=torch.float32, device=device)
    argkey = torch.empty(heads, tokens, width, dtype=torch.int32, device=device)
    kl_rows = torch.empty(heads, tokens, dtype=torch.float32, device=device)
    lse = torch.empty_like(kl_rows)
    tsum = torch.empty_like(kl_rows)
    pointers = subset_pointers(subset, _QT, blocks)
    grid = (blocks.num_blocks_bound * (block // _QT) if subset is None
            else pointers["tiles_ptr"].numel(), heads)
    _dense_kl_fwd_kernel[grid](
        query, key, iq, ik, blocks.block_doc, blocks.block_local, blocks.cu_seqlens,
        target, argkey, kl_rows, lse, tsum,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), iq.stride(0),
        iq.stride(1), ik.stride(0), target.stride(0), target.stride(1), kl_rows.stride(0),
        softmax_scale * LOG2E, 1.0 / math.sqrt(index_dim), pointers["tiles_ptr"],
        pointers["qrow_ptr"], HG=group, HGP=triton.next_power_of_2(group), QT=_QT, BS=block,
        D=head_dim, DI=index_dim, FP32_DOT=INTERPRET, num_warps=8 if group * _QT >= 256 else 4,
        num_stages=2, SUBSET=subset is not None,
    )
    stats: dict[str, torch.Tensor] = {}
    if q2k is not None:
        # Exact recall from the stored target: the selected slots' mass (slots past the token's
        # own block hold no target and are out of contract anyway).
        own = ((blocks if subset is None else subset).token_pos.long() // block)[None, :, None]
        slots = q2k.long()
        live = (slots >= 0) & (slots <= own)
        mass = target.gather(2, slots.clamp(0, width - 1))
        stats["recall_mass"] = torch.where(live, mass, 0.0).sum()
        stats["recall_count"] = torch.full((), float(tokens * heads), device=device)
    denominator = float(blocks.num_tokens * num_index_heads_total)
    kl = _DenseKL.apply(index_q, index_k, kl_rows, target, argkey, lse, tsum, blocks,
                        1.0 / math.sqrt(index_dim), denominator, subset)
    stats["kl"] = kl.detach()
    return kl * loss_coeff, stats
