"""The sampled selection recall in Triton: one program per (sampled token, KV group).

For the sampled token at document position p and KV group g the program holds the group's query
heads as the rows of one tile, passes once over the token's visible keys (blocks 0..p // block of
its own document, block-causal) for each head's dense log-sum-exp, then sums each head's softmax
mass over the keys of the selected blocks only. The torch version
(:func:`nemo_msa.indexer_loss.recall.sampled_selection_recall` with ``fused=False``, the
reference) scores every sampled row against the whole aligned workspace and materializes fp32
[rows, Hq, W] scores: on the H200 about 7 ms per layer at 32768 tokens (issue #28's profile),
growing with T; here the work is the sampled rows' own visible keys, and nothing is stored but
one fp32 per (group, token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nemo_msa.triton.kernel_layout import INTERPRET
from nemo_msa.triton.tiles import LOG2E

__all__ = ["selection_recall_rows_triton"]


@triton.jit
def _recall_kernel(
    q_ptr, k_ptr, q2k_ptr, rows_ptr, start_ptr, pos_ptr, out_ptr,
    n, stride_qt, stride_qh, stride_kt, stride_kh, stride_sg, stride_st, scale_log2,
    HG: tl.constexpr, HGP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
    TOPK: tl.constexpr, FP32_DOT: tl.constexpr,
):
    i = tl.program_id(0)
    g = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    start = tl.load(start_ptr + i).to(tl.int64)
    p = tl.load(pos_ptr + i).to(tl.int64)
    heads = tl.arange(0, HGP)
    head_ok = heads < HG
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + row * stride_qt + (g * HG + heads)[:, None] * stride_qh + dd[None, :],
                mask=head_ok[:, None], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    cols = tl.arange(0, BS)
    own = p // BS
    m = tl.full([HGP], -float("inf"), tl.float32)
    lsum = tl.zeros([HGP], tl.float32)
    for j in range(0, own + 1):
        kpos = j * BS + cols
        k_ok = kpos <= p
        k = tl.load(k_ptr + (start + kpos)[:, None] * stride_kt + g * stride_kh + dd[None, :],
                    mask=k_ok[:, None], other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
        s = tl.where(k_ok[None, :], tl.dot(q, tl.trans(k)) * scale_log2, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        lsum = lsum * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log2(lsum)
    covered = tl.zeros([HGP], tl.float32)
    for slot in tl.static_range(TOPK):
        b = tl.load(q2k_ptr + g * stride_sg + i * stride_st + slot).to(tl.int64)
        live = (b >= 0) & (b <= own)
        kpos = tl.where(live, b, 0) * BS + cols
        k_ok = (kpos <= p) & live
        k = tl.load(k_ptr + (start + kpos)[:, None] * stride_kt + g * stride_kh + dd[None, :],
                    mask=k_ok[:, None], other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        covered += tl.sum(tl.where(k_ok[None, :], tl.exp2(s - lse[:, None]), 0.0), axis=1)
    tl.store(out_ptr + g * n + i, tl.sum(tl.where(head_ok, covered, 0.0)) / HG)


def selection_recall_rows_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    q2k_rows: torch.Tensor,
    rows: torch.Tensor,
    msa,
    softmax_scale: float,
) -> torch.Tensor:
    """Per (KV group, sampled token): the dense attention's mass, averaged over the group's
    query heads, inside the token's selected blocks.

    Args:
        query: [T, Hq, d] bf16/fp16 queries after RoPE (d a power of two, 16..128).
        key: [T, G, d] keys, query's dtype.
        q2k_rows: int32 [G, n, top_k] the sampled tokens' selected blocks.
        rows: int64 [n] compact rows of the sampled tokens (every token a query).
        msa: the microbatch layout.
        softmax_scale: the main attention's scale.

    Returns:
        fp32 [G, n].
    """
    n = rows.shape[0]
    heads, group = key.shape[1], query.shape[1] // key.shape[1]
    out = torch.empty(heads, n, dtype=torch.float32, device=query.device)
    if n == 0:
        return out
    query, key, q2k_rows = query.contiguous(), key.contiguous(), q2k_rows.contiguous()
    starts = msa.token_document_starts[rows].contiguous()
    positions = msa.document_positions[rows].contiguous()
    _recall_kernel[(n, heads)](
        query, key, q2k_rows, rows.contiguous(), starts, positions, out, n,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), q2k_rows.stride(0),
        q2k_rows.stride(1), softmax_scale * LOG2E,
        HG=group, HGP=max(16, triton.next_power_of_2(group)), BS=msa.block_size,
        D=query.shape[-1], TOPK=q2k_rows.shape[-1], FP32_DOT=INTERPRET, num_warps=4,
    )
    return out
