"""The by-product indexer loss in Triton: the selected blocks' scores, the KL with its score
gradient, and d index_q / d index_k through each selected block's argmax key.

The selection ranks blocks by their score (max of q.k over the block's visible keys) but keeps
only the ids; the loss's scores and argmax keys come from a block-major pass over the selected
slots (ADR 0033), and its gradients from a second one:

* :func:`block_plan` sorts the slots by (key block, head) once (a stable sort: a fixed order)
  and splits each block's slots into chunks (:func:`plan_chunk`: at most ``_CHUNK``, fewer
  where the row is short), so that a block many tokens select is not one long program and the
  chunks outnumber the SMs;
* :func:`block_scores_triton` (forward): one program per chunk loads its block's index keys
  once, scores the chunk's index queries against them (one MMA per ``_BE`` slots) and writes
  each slot's max and the first key attaining it;
* :func:`sparse_kl_forward_triton` reads the scores and the target (the attention's block mass)
  once and writes each row's KL and the unit score gradient ``(softmax(scale s) * sum(P) - P)
  * scale``, which the backward only scales;
* :func:`byproduct_grads_triton` (backward): per chunk, ``d index_k`` of the block's keys as a
  one-hot MMA ``onehot(key)^T (g q)`` (written directly where the block is one chunk; a block
  split into several gets partial sums, added in chunk order by a second kernel), and per
  (32 tokens, head) ``d index_q = sum_k g index_k[key]``.

No atomics anywhere: the result is the same bits run to run, and a deterministic-algorithms
request keeps these kernels. The torch reference is :mod:`nemo_msa.indexer_loss.byproducts`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nemo_msa.triton.kernel_layout import INTERPRET, kernel_layout, query_subset
from nemo_msa.triton.tiles import doc_block, row_max_keep_nan

__all__ = ["BlockPlan", "block_plan", "block_scores_triton", "byproduct_grads_triton",
           "plan_chunk", "sparse_kl_forward_triton"]

# Tokens per program of d index_q: the [BT, d] accumulator and index_q rows stay in registers.
_BT = 32
# Slots per program of the block-major passes (at most: a block's slots split into chunks), and
# per step of one (the rows of its MMAs; 32 keeps the [32, block] score tile and the [block, d]
# accumulator of 8 warps free of spills, benchmarks/kernel_report.py).
_CHUNK = 8192
# The chunk shrinks (by powers of two, to _MIN_CHUNK) until the slots make about _PROGRAMS
# chunks, four per SM of an H100/H200 (132). A chunk's program runs its steps in series, and a
# block's slots scale with the row: at 8192 tokens a block averages 8192 slots (4 heads x 16
# slots x 8192 tokens / 64 blocks), so chunks of 8192 made fewer programs than SMs, each
# running 256 steps, and the two passes took 1.7-3x their per-slot time at 131072 tokens
# (0.65 / 0.55 ms against 3.4 / 5.3 ms for 16x the slots). Depending on the slot count alone,
# the chunking (and so d index_k's summation order) is the same on any GPU and every run.
_MIN_CHUNK = 1024
_PROGRAMS = 512
_BE = 32
_WARPS = 8
# Tokens per program of the KL forward and of the plan's sort keys: [BT, top_k] tiles.
_BT_KL = 64
#: Per kernel view (built once per microbatch): each block's first sort key, shared by every
#: layer.
_SEGMENT_STARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@triton.jit
def _sparse_kl_fwd_kernel(
    s_ptr, p_ptr, kl_ptr, du_ptr, T, scale, eps,
    K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
):
    # One program per (BT tokens, head); [H, T, K] contiguous inputs, rows of K slots.
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t = pid * BT + tl.arange(0, BT)
    kk = tl.arange(0, KP)
    ok = (t < T)[:, None] & (kk < K)[None, :]
    row = h.to(tl.int64) * T + t.to(tl.int64)
    offs = row[:, None] * K + kk[None, :]
    x = tl.load(s_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32) * scale
    p = tl.load(p_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    m = tl.max(x, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row without a finite slot: no -inf - -inf
    e = tl.exp(x - m[:, None])
    z = tl.sum(e, 1)
    log_q = x - (m + tl.log(z))[:, None]  # log_softmax; NaN anywhere in the row spreads
    terms = tl.where(p > 0, p * (tl.log(tl.maximum(p, eps)) - log_q), 0.0)
    tl.store(kl_ptr + row, tl.sum(terms, 1), mask=t < T)
    du = (e / z[:, None] * tl.sum(p, 1)[:, None] - p) * scale
    tl.store(du_ptr + offs, du, mask=ok)


def sparse_kl_forward_triton(
    scores: torch.Tensor, target: torch.Tensor, scale: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's KL of the by-product loss and its unit score gradient, in one kernel.

    Args:
        scores: fp32 [H, T, K] unscaled block scores, -inf at unused slots.
        target: fp32 [H, T, K] target mass per slot (0 at unused slots).
        scale: the index softmax scale (1 / sqrt(d_idx)).
        eps: the floor of ``P`` inside ``log P`` (only slots with ``P > 0`` count).

    Returns:
        ``(kl fp32 [H, T], unit fp32 [H, T, K])``: ``kl[h, t] = sum_k P log(P / Q)`` over slots
        with ``P > 0``, Q the softmax of ``scale * scores``; ``unit = (Q sum(P) - P) * scale``,
        the gradient of ``kl[h, t]`` in the unscaled scores.
    """
    heads, tokens, top_k = scores.shape
    scores = scores.contiguous()
    target = target.contiguous()
    kl = torch.empty(heads, tokens, dtype=torch.float32, device=scores.device)
    unit = torch.empty(heads, tokens, top_k, dtype=torch.float32, device=scores.device)
    if tokens and heads:
        _sparse_kl_fwd_kernel[(triton.cdiv(tokens, _BT_KL), heads)](
            scores, target, kl, unit, tokens, float(scale), float(eps), K=top_k,
            KP=triton.next_power_of_2(top_k), BT=_BT_KL, num_warps=4,
        )
    return kl, unit


@triton.jit
def _chunk_span(p, chunk_block_ptr, offsets_ptr, end_ptr, bound, block_doc_ptr,
                block_local_ptr, cu_ptr, CHUNK: tl.constexpr):
    """Chunk ``p`` of a :class:`BlockPlan`: ``(blk, lo, hi, c, n, o, start, length)``: its
    global block, its slots ``entries[lo:hi]`` (empty for the surplus chunks of the grid's host
    bound), chunk ``c`` of the block's ``n``, and the block's document-local id, document start
    row and document length."""
    blk = tl.load(chunk_block_ptr + p)
    real = blk < bound
    blk = tl.minimum(blk, bound - 1)
    b0 = tl.load(offsets_ptr + blk)
    b1 = tl.load(offsets_ptr + blk + 1)
    n = (b1 - b0 + CHUNK - 1) // CHUNK
    c = p - (tl.load(end_ptr + blk) - n)
    lo = b0 + c * CHUNK
    _, o, start, length = doc_block(blk, block_doc_ptr, block_local_ptr, cu_ptr)
    return blk, lo, tl.where(real, tl.minimum(lo + CHUNK, b1), lo), c, n, o, start, length


@triton.jit
def _slot_rows(entry_ptr, e, r, hi, TQ, K: tl.constexpr):
    """Slots ``entries[e:e + BE]``: ``(ok, flat, t, h)``, flat the index into [H, TQ, K]."""
    ok = e + r < hi
    flat = tl.load(entry_ptr + e + r, mask=ok, other=0).to(tl.int64)
    ht = flat // K
    return ok, flat, ht % TQ, ht // TQ


@triton.jit
def _plan_keys_kernel(
    q2k_ptr, pos_ptr, first_ptr, key_ptr, TQ, heads, sentinel,
    K: tl.constexpr, KP: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
):
    """Sort keys of the slots of ``BT`` queries x one head: ``(global block) * H + head``, and
    ``sentinel`` (past every block) for a slot that is -1 or names a block past the query's
    own, so that the sort puts it at the tail."""
    h = tl.program_id(1)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    kk = tl.arange(0, KP)
    ok = (t < TQ)[:, None] & (kk < K)[None, :]
    offs = (h.to(tl.int64) * TQ + t.to(tl.int64))[:, None] * K + kk[None, :]
    b = tl.load(q2k_ptr + offs, mask=ok, other=-1).to(tl.int64)
    own = (tl.load(pos_ptr + t, mask=t < TQ, other=0) // BS).to(tl.int64)
    first = tl.load(first_ptr + t, mask=t < TQ, other=0).to(tl.int64)
    valid = (b >= 0) & (b <= own[:, None])
    key = tl.where(valid, (first[:, None] + b) * heads + h, sentinel)
    tl.store(key_ptr + offs, key.to(key_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _block_scores_kernel(
    entry_ptr, chunk_block_ptr, offsets_ptr, end_ptr, bound, block_doc_ptr, block_local_ptr,
    cu_ptr, tok_pos_ptr, iq_ptr, ik_ptr, score_ptr, keys_ptr,
    TQ, stride_iqt, stride_iqh, stride_ikt,
    K: tl.constexpr, BS: tl.constexpr, DI: tl.constexpr, BE: tl.constexpr,
    CHUNK: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """Chunk ``program_id(0)``: each slot's block score (max of q.k over the keys its query
    sees, NaN when one of them is) and the first key attaining it (the first NaN's where the
    score is NaN), written at the slot's flat index of [H, TQ, K]."""
    _, lo, hi, _, _, o, start, length = _chunk_span(
        tl.program_id(0), chunk_block_ptr, offsets_ptr, end_ptr, bound, block_doc_ptr,
        block_local_ptr, cu_ptr, CHUNK)
    if lo >= hi:
        return
    cols = tl.arange(0, BS)
    de = tl.arange(0, DI)
    j = o * BS + cols  # document-local key positions of the block
    kb = tl.load(ik_ptr + (start + j).to(tl.int64)[:, None] * stride_ikt + de[None, :],
                 mask=(j < length)[:, None], other=0.0)
    if FP32_DOT:
        kb = kb.to(tl.float32)
    r = tl.arange(0, BE)
    for e in range(lo, hi, BE):
        ok, flat, t, h = _slot_rows(entry_ptr, e, r, hi, TQ, K)
        pos = tl.load(tok_pos_ptr + t, mask=ok, other=-1)
        q = tl.load(iq_ptr + t[:, None] * stride_iqt + h[:, None] * stride_iqh + de[None, :],
                    mask=ok[:, None], other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)
        vis = j[None, :] <= pos[:, None]  # a slot's query sees key 0 of its block at least
        s = tl.where(vis, tl.dot(q, tl.trans(kb)), float("-inf"))
        smax = row_max_keep_nan(s)
        top = vis & ((s == smax[:, None]) | ((s != s) & (smax != smax)[:, None]))
        arg = tl.min(tl.where(top, cols[None, :], BS), axis=1)
        tl.store(score_ptr + flat, smax, mask=ok)
        tl.store(keys_ptr + flat, (start + o * BS + arg).to(tl.int32), mask=ok)


@triton.jit
def _dk_onehot_kernel(
    entry_ptr, chunk_block_ptr, offsets_ptr, end_ptr, bound, block_doc_ptr, block_local_ptr,
    cu_ptr, iq_ptr, keys_ptr, dscore_ptr, factor_ptr, split_end_ptr, part_ptr, dk_ptr,
    TQ, stride_iqt, stride_iqh, stride_dkt,
    K: tl.constexpr, BS: tl.constexpr, DI: tl.constexpr, BE: tl.constexpr,
    CHUNK: tl.constexpr, FACTOR: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """Chunk ``program_id(0)``: the sum over its slots of ``g q`` onto the slot's argmax key (a
    row of the chunk's block), written as the block's d index_k where the block has one chunk,
    else as the chunk's partial [BS, DI] fp32 in ``part`` (slot ``split_end[blk] - n + c``)."""
    blk, lo, hi, c, n, o, start, length = _chunk_span(
        tl.program_id(0), chunk_block_ptr, offsets_ptr, end_ptr, bound, block_doc_ptr,
        block_local_ptr, cu_ptr, CHUNK)
    if lo >= hi:
        return
    cols = tl.arange(0, BS)
    de = tl.arange(0, DI)
    factor = 1.0
    if FACTOR:
        factor = tl.load(factor_ptr).to(tl.float32)
    r = tl.arange(0, BE)
    acc = tl.zeros([BS, DI], tl.float32)
    for e in range(lo, hi, BE):
        ok, flat, t, h = _slot_rows(entry_ptr, e, r, hi, TQ, K)
        col = tl.load(keys_ptr + flat, mask=ok, other=0) - (start + o * BS)
        g = tl.load(dscore_ptr + flat, mask=ok, other=0.0) * factor
        q = tl.load(iq_ptr + t[:, None] * stride_iqt + h[:, None] * stride_iqh + de[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        gq = g[:, None] * q
        # Rows holding a NaN/Inf stay out of the one-hot MMA (0 * inf is NaN for every other
        # key of the block) and are added row by row below.
        bad = ok & (tl.max(((gq != gq) | (tl.abs(gq) == float("inf"))).to(tl.int32), 1) > 0)
        gq_ok = tl.where(bad[:, None], 0.0, gq)
        hit_t = tl.where(cols[:, None] == tl.where(ok & ~bad, col, BS)[None, :], 1.0, 0.0)
        if FP32_DOT:
            acc += tl.dot(hit_t, gq_ok)
        else:
            # one-hot^T [BS, BE] is exact in bf16; g q as two bf16 terms keeps 16 bits of its
            # mantissa, far below the bf16 d index_k's rounding.
            hit_t = hit_t.to(tl.bfloat16)
            high = gq_ok.to(tl.bfloat16)
            acc += tl.dot(hit_t, high)
            acc += tl.dot(hit_t, (gq_ok - high.to(tl.float32)).to(tl.bfloat16))
        if tl.sum(bad.to(tl.int32)) > 0:
            for m in range(BE):
                one = (r == m) & bad
                row = tl.sum(tl.where(one[:, None], gq, 0.0), axis=0)
                at = tl.sum(tl.where(one, col, 0))
                acc += tl.where((cols[:, None] == at) & (tl.sum(one.to(tl.int32)) > 0),
                                row[None, :], 0.0)
    if n == 1:
        j = o * BS + cols
        tl.store(dk_ptr + (start + j).to(tl.int64)[:, None] * stride_dkt + de[None, :],
                 acc.to(dk_ptr.dtype.element_ty), mask=(j < length)[:, None])
    else:
        slot = tl.load(split_end_ptr + blk) - n + c  # int64
        tl.store(part_ptr + slot * (BS * DI) + cols[:, None] * DI + de[None, :], acc)


@triton.jit
def _dk_reduce_kernel(
    part_ptr, offsets_ptr, split_end_ptr, block_doc_ptr, block_local_ptr, cu_ptr, dk_ptr,
    stride_dkt, BS: tl.constexpr, DI: tl.constexpr, CHUNK: tl.constexpr,
):
    """Key block ``program_id(0)`` of more than one chunk: d index_k of its rows, its chunks'
    partials added in chunk order (a block of one chunk was written by its chunk, a block no
    slot selected keeps its zeros)."""
    blk = tl.program_id(0)
    n = (tl.load(offsets_ptr + blk + 1) - tl.load(offsets_ptr + blk) + CHUNK - 1) // CHUNK
    if n <= 1:
        return
    c0 = tl.load(split_end_ptr + blk) - n  # int64
    cols = tl.arange(0, BS)
    de = tl.arange(0, DI)
    tile = cols[:, None] * DI + de[None, :]
    acc = tl.zeros([BS, DI], tl.float32)
    for i in range(0, n):
        acc += tl.load(part_ptr + (c0 + i) * (BS * DI) + tile)
    _, o, start, length = doc_block(blk, block_doc_ptr, block_local_ptr, cu_ptr)
    j = o * BS + cols
    tl.store(dk_ptr + (start + j).to(tl.int64)[:, None] * stride_dkt + de[None, :],
             acc.to(dk_ptr.dtype.element_ty), mask=(j < length)[:, None])


@triton.jit
def _sparse_kl_dq_kernel(
    dscore_ptr, keys_ptr, ik_ptr, dq_ptr, factor_ptr,
    T, stride_sh, stride_st, stride_ikt, stride_dqt,
    K: tl.constexpr, BT: tl.constexpr, DI: tl.constexpr, FACTOR: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t = pid * BT + tl.arange(0, BT)
    ok = t < T
    t64 = t.to(tl.int64)
    de = tl.arange(0, DI)
    acc = tl.zeros([BT, DI], tl.float32)
    base = h * stride_sh + t64 * stride_st
    factor = 1.0
    if FACTOR:
        factor = tl.load(factor_ptr).to(tl.float32)
    for k in tl.static_range(K):
        key = tl.load(keys_ptr + base + k, mask=ok, other=-1)
        used = ok & (key >= 0)
        g = tl.load(dscore_ptr + base + k, mask=used, other=0.0) * factor
        g = tl.where(used, g, 0.0)
        row = tl.where(used, key, 0).to(tl.int64)
        ik = tl.load(ik_ptr + row[:, None] * stride_ikt + de[None, :], mask=used[:, None],
                     other=0.0).to(tl.float32)
        acc += g[:, None] * ik
    tl.store(dq_ptr + t64[:, None] * stride_dqt + h * DI + de[None, :], acc, mask=ok[:, None])


@dataclass(frozen=True)
class BlockPlan:
    """The selected slots in block-major order, in chunks (built by :func:`block_plan`).

    Attributes:
        entries: int32 (int64 past 2^31 slots) [H * Tq * K]; flat slot indices of [H, Tq, K]
            sorted by (global key block, head), ascending token within each; slots that are -1
            or name a block past the query's own at the tail.
        offsets: int64 [num_blocks_bound + 1]; block ``b``'s slots are
            ``entries[offsets[b]:offsets[b + 1]]``.
        end: int64 [num_blocks_bound]; cumulative chunk count: block ``b`` owns chunks
            ``end[b] - ceil(n_b / chunk) .. end[b] - 1``.
        split_end: int64 [num_blocks_bound]; the same count over the blocks of more than one
            chunk only: the partial sums of block ``b``'s chunks are rows
            ``split_end[b] - ceil(n_b / chunk) ..`` of the backward's buffer.
        chunk_block: int64 [num_chunks]; each chunk's block (``num_blocks_bound`` for the
            surplus chunks of the host bound ``ceil(H Tq K / chunk) + num_blocks_bound``).
        chunk: most slots per chunk.
    """

    entries: torch.Tensor
    offsets: torch.Tensor
    end: torch.Tensor
    split_end: torch.Tensor
    chunk_block: torch.Tensor
    chunk: int

    @property
    def num_chunks(self) -> int:
        return self.chunk_block.numel()

    @property
    def num_split_chunks(self) -> int:
        """A host bound on the chunks of blocks of more than one chunk: such a block has more
        than ``chunk`` slots, so its ``ceil(n / chunk)`` chunks are fewer than ``2 n / chunk``."""
        return max(1, -(-2 * self.entries.numel() // self.chunk))


def _segment_starts(view, heads: int, idx: torch.dtype) -> torch.Tensor:
    """``[num_blocks_bound + 1]`` the first sort key of each global block (``b * H``), kept
    on the layout's kernel view for every layer of the microbatch."""
    per_view = _SEGMENT_STARTS.setdefault(view, {})
    found = per_view.get((heads, idx))
    if found is None:
        found = per_view[(heads, idx)] = torch.arange(
            view.num_blocks_bound + 1, device=view.cu_seqlens.device, dtype=idx) * heads
    return found


def plan_chunk(slots: int) -> int:
    """Most slots per chunk of a plan over ``slots`` selected slots: the power of two that
    makes about ``_PROGRAMS`` chunks, within ``[_MIN_CHUNK, _CHUNK]``."""
    want = -(-max(int(slots), 1) // _PROGRAMS)
    return min(_CHUNK, max(_MIN_CHUNK, triton.next_power_of_2(want)))


def block_plan(q2k: torch.Tensor, msa, queries: torch.Tensor | None = None,
               chunk: int | None = None) -> BlockPlan:
    """The block-major order of the selected slots and its chunks, with device ops only.

    Args:
        q2k: int32 [H, Tq, K] document-local block ids, -1 for none (Tq = T without
            ``queries``).
        msa: the layout (``MSAMicrobatch`` or ``KernelLayout``).
        queries: int64 [Tq] global compact rows of the queries, or None for every token.
        chunk: most slots per chunk; None takes :func:`plan_chunk` of the slot count (tests
            give small ones).

    Returns:
        The :class:`BlockPlan`.
    """
    heads, tq, top_k = q2k.shape
    bs = msa.block_size
    view = kernel_layout(msa, bs)
    subset = query_subset(msa, bs, queries)
    rows = view if subset is None else subset
    bound = view.num_blocks_bound
    total = heads * tq * top_k
    chunk = plan_chunk(total) if chunk is None else int(chunk)
    wide = (bound + 1) * heads >= 2**31 or total >= 2**31
    idx = torch.int64 if wide else torch.int32
    q2k = q2k.contiguous()
    key = torch.empty(total, dtype=idx, device=q2k.device)
    if total:
        _plan_keys_kernel[(triton.cdiv(tq, _BT_KL), heads)](
            q2k, rows.token_pos, rows.token_first_block, key, tq, heads, bound * heads,
            K=top_k, KP=max(2, triton.next_power_of_2(top_k)), BS=bs, BT=_BT_KL, num_warps=4,
        )
    sorted_keys, entries = torch.sort(key, stable=True)
    del key
    offsets = torch.searchsorted(sorted_keys, _segment_starts(view, heads, idx))
    count = (offsets[1:] - offsets[:-1] + chunk - 1) // chunk
    end = torch.cumsum(count, 0)
    split_end = torch.cumsum(count * (count > 1), 0)
    num_chunks = -(-total // chunk) + bound
    ids = torch.arange(num_chunks, device=q2k.device, dtype=torch.int64)
    return BlockPlan(entries=entries.to(idx), offsets=offsets, end=end, split_end=split_end,
                     chunk_block=torch.searchsorted(end, ids, right=True), chunk=chunk)


def _plan_args(plan: BlockPlan, view) -> dict:
    return dict(entry_ptr=plan.entries, chunk_block_ptr=plan.chunk_block,
                offsets_ptr=plan.offsets, end_ptr=plan.end, bound=view.num_blocks_bound,
                block_doc_ptr=view.block_doc, block_local_ptr=view.block_local,
                cu_ptr=view.cu_seqlens, CHUNK=plan.chunk)


def block_scores_triton(
    index_q: torch.Tensor, index_k: torch.Tensor, q2k: torch.Tensor, msa,
    queries: torch.Tensor | None = None, chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, BlockPlan]:
    """Each selected slot's block score and argmax key, block-major.

    Args:
        index_q: bf16/fp16 [Tq, H, d] index queries (Tq = T without ``queries``).
        index_k: [T, d], index_q's dtype (d a power of two, 16..128).
        q2k: int32 [H, Tq, K] the selection (document-local block ids, -1 at unused slots).
        msa: the layout the selection ran on (its ``block_size``).
        queries: int64 [Tq] global compact rows of index_q's tokens, or None for every token.
        chunk: most slots per program; None takes :func:`plan_chunk` (see :func:`block_plan`).

    Returns:
        ``(scores fp32 [H, Tq, K], keys int32 [H, Tq, K], plan)``: the max of q.k over the
        block's keys the query sees (its own block up to itself; NaN when one of them is NaN),
        -inf at unused slots; the global compact row of the first key attaining it (the first
        NaN's), -1 at unused slots; the :class:`BlockPlan` the backward reuses.
    """
    heads, tokens, top_k = q2k.shape
    view = kernel_layout(msa, msa.block_size)
    subset = query_subset(msa, msa.block_size, queries)
    rows = view if subset is None else subset
    iq = index_q.contiguous()
    ik = index_k.contiguous()
    scores = torch.full((heads, tokens, top_k), -torch.inf, dtype=torch.float32,
                        device=iq.device)
    keys = torch.full((heads, tokens, top_k), -1, dtype=torch.int32, device=iq.device)
    plan = block_plan(q2k, msa, queries, chunk)
    if tokens:
        _block_scores_kernel[(plan.num_chunks,)](
            **_plan_args(plan, view), tok_pos_ptr=rows.token_pos, iq_ptr=iq, ik_ptr=ik,
            score_ptr=scores, keys_ptr=keys, TQ=tokens, stride_iqt=iq.stride(0),
            stride_iqh=iq.stride(1), stride_ikt=ik.stride(0), K=top_k, BS=view.block_size,
            DI=iq.shape[-1], BE=_BE, FP32_DOT=INTERPRET, num_warps=_WARPS,
        )
    return scores, keys, plan


def byproduct_grads_triton(
    dscore: torch.Tensor, keys: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    msa, plan: BlockPlan, factor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """d index_q and d index_k through each selected slot's argmax key, without atomics.

    Args:
        dscore: fp32 [H, Tq, K] gradient of each slot's block score (times ``factor``).
        keys: int32 [H, Tq, K] each slot's argmax key (:func:`block_scores_triton`), -1 at
            unused slots.
        index_q: [Tq, H, d] bf16/fp16; index_k: [T, d], same dtype.
        msa: the layout; plan: the forward's :class:`BlockPlan` of the same selection.
        factor: optional fp32 one-element tensor multiplying ``dscore`` inside the kernels (the
            incoming gradient over the loss's denominator: read on the device, no host sync,
            no extra kernel).

    Returns:
        ``(d index_q [Tq, H, d], d index_k [T, d])`` in the inputs' dtypes (fp32 inside).
    """
    heads, tokens, top_k = dscore.shape
    dim = index_q.shape[-1]
    view = kernel_layout(msa, msa.block_size)
    dscore = dscore.contiguous()
    keys = keys.contiguous()
    iq = index_q.contiguous()
    ik = index_k.contiguous()
    # d index_q is written once per element: stored in index_q's dtype directly (the same
    # rounding as a cast after); d index_k's rows are written once, by the reduce kernel.
    dq = torch.empty(tokens, heads, dim, dtype=index_q.dtype, device=iq.device)
    dk = torch.zeros(ik.shape[0], dim, dtype=index_k.dtype, device=iq.device)
    if not tokens:
        return dq, dk
    fac = dscore if factor is None else factor
    bs = view.block_size
    # Partial sums only for the chunks of blocks split into several (most blocks have one).
    part = torch.empty(plan.num_split_chunks, bs, dim, dtype=torch.float32, device=iq.device)
    _dk_onehot_kernel[(plan.num_chunks,)](
        **_plan_args(plan, view), iq_ptr=iq, keys_ptr=keys, dscore_ptr=dscore, factor_ptr=fac,
        split_end_ptr=plan.split_end, part_ptr=part, dk_ptr=dk, TQ=tokens,
        stride_iqt=iq.stride(0), stride_iqh=iq.stride(1), stride_dkt=dk.stride(0), K=top_k,
        BS=bs, DI=dim, BE=_BE, FACTOR=factor is not None, FP32_DOT=INTERPRET, num_warps=_WARPS,
    )
    _dk_reduce_kernel[(view.num_blocks_bound,)](
        part, plan.offsets, plan.split_end, view.block_doc, view.block_local, view.cu_seqlens,
        dk, dk.stride(0), BS=bs, DI=dim, CHUNK=plan.chunk, num_warps=4,
    )
    _sparse_kl_dq_kernel[(triton.cdiv(tokens, _BT), heads)](
        dscore, keys, ik, dq, fac, tokens, dscore.stride(0), dscore.stride(1), ik.stride(0),
        dq.stride(0), K=top_k, BT=_BT, DI=dim, FACTOR=factor is not None, num_warps=4,
    )
    return dq, dk
