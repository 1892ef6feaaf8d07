"""Experimental KV-outer MSA forward (two passes, fp32 atomics); measured for ADR 0003.

Not registered as the backend's forward: it is nondeterministic (atomic summation order) and
needs O(Hq * T * top_k) fp32 statistics. It exists so that the schedule choice is a measurement:
the query-outer forward (triton_fwd.py) reads every selected K/V block once per (token, KV
head), 16 FLOP per byte, while this one reads each block once per (KV head, block) and gathers
the 4 KB Q rows of the queries that chose it.

Pass 1: per (KV head, block), over the block's query list in tiles of QT tokens x G heads,
the per-entry row max ``m`` and ``l = sum exp2(s - m)`` (log2 domain). Torch combines the
``top_k`` entries of each (token, head) into the lse. Pass 2: same walk, ``P = exp2(s - lse)``
exact, ``out32 += P V`` with atomics; then one cast to the output dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nemo_msa.attention.triton_fwd import check_attention_inputs
from nemo_msa.attention.triton_layout import INTERPRET, block_query_csr, doc_blocks
from nemo_msa.attention.triton_tiles import LOG2E, csr_entry_rows, doc_block, load_rows, next_pow2

CONFIG = {"rows": 64, "num_warps": 4, "num_stages": 2}


@triton.jit
def _kv_pass_kernel(
    q_ptr, k_ptr, v_ptr, lse2_ptr, m_ptr, l_ptr, out_ptr,
    offsets_ptr, list_ptr, order_ptr, block_doc_ptr, block_local_ptr, cu_ptr, tok_pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lh, n_entries,
    num_blocks_bound, scale_log2,
    PASS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, QT: tl.constexpr,
    BS: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr,
):
    BM: tl.constexpr = QT * GP
    seg = tl.load(order_ptr + tl.program_id(0))
    g = seg // num_blocks_bound
    blk = seg % num_blocks_bound
    doc, b, start, length = doc_block(blk, block_doc_ptr, block_local_ptr, cu_ptr)
    if doc < 0:
        return
    kn = tl.arange(0, BS)
    j = b * BS + kn
    kvalid = j < length
    rows_k = (start + j).to(tl.int64)
    dd = tl.arange(0, D)
    k = tl.load(k_ptr + rows_k[:, None] * stride_kt + g * stride_kh + dd[None, :],
                mask=kvalid[:, None], other=0.0)
    if FP32_DOT:
        k = k.to(tl.float32)
    if PASS == 2:
        v = tl.load(v_ptr + rows_k[:, None] * stride_vt + g * stride_vh + dd[None, :],
                    mask=kvalid[:, None], other=0.0)
        if FP32_DOT:
            v = v.to(tl.float32)
    lo = tl.load(offsets_ptr + seg)
    hi = tl.load(offsets_ptr + seg + 1)
    r = tl.arange(0, BM)
    r_tok = r // GP
    r_head = r % GP
    heads = g * G + r_head
    for e in range(lo, hi, QT):
        ent, rmask, tok, pos = csr_entry_rows(list_ptr, tok_pos_ptr, e, hi, r_tok, r_head, G)
        q = load_rows(q_ptr, tok, heads, rmask, stride_qt, stride_qh, D)
        if FP32_DOT:
            q = q.to(tl.float32)
        vis = (j[None, :] <= pos[:, None]) & rmask[:, None]
        sc = tl.dot(q, tl.trans(k)) * scale_log2
        sc = tl.where(vis, sc, float("-inf"))
        if PASS == 1:
            m = tl.max(sc, axis=1)
            m_use = tl.where(m == float("-inf"), 0.0, m)
            lsum = tl.sum(tl.exp2(sc - m_use[:, None]), axis=1)
            sidx = r_head.to(tl.int64) * n_entries + ent
            tl.store(m_ptr + sidx, m, mask=rmask)
            tl.store(l_ptr + sidx, lsum, mask=rmask)
        else:
            lse2 = tl.load(lse2_ptr + heads * stride_lh + tok, mask=rmask, other=0.0)
            pr = tl.where(vis, tl.exp2(sc - lse2[:, None]), 0.0)
            if FP32_DOT:
                o = tl.dot(pr, v)
            else:
                o = tl.dot(pr.to(v.dtype), v)
            optr = out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + dd[None, :]
            tl.atomic_add(optr, o, mask=rmask[:, None], sem="relaxed")


def triton_attention_forward_kvouter(q, k, v, q2k, msa, softmax_scale=None, *,
                                     block_size=None):
    """KV-outer two-pass forward; same contract as ``triton_attention_forward``.

    Args:
        q: bf16/fp16 [T, Hq, d]; k, v: same dtype [T, Hkv, d]; q2k: int32 [Hkv, T, top_k].
        msa: the layout; softmax_scale: defaults to 1/sqrt(d); block_size: msa.block_size.

    Returns:
        ``(out [T, Hq, d] q's dtype, lse fp32 [Hq, T])``.
    """
    bs = int(block_size if block_size is not None else getattr(msa, "block_size", 128))
    t, hq, hkv, d, grp, top_k = check_attention_inputs(q, k, v, q2k, msa, bs)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    blocks = doc_blocks(msa, bs)
    q_, k_, v_ = (x.contiguous() for x in (q, k, v))
    q2k_ = q2k.contiguous()
    csr = block_query_csr(q2k_, blocks, msa)
    n_entries = hkv * t * top_k
    gp = max(16, next_pow2(grp))
    qt = max(1, CONFIG["rows"] // gp)
    m = torch.full((gp, n_entries), float("-inf"), dtype=torch.float32, device=q.device)
    lsum = torch.zeros((gp, n_entries), dtype=torch.float32, device=q.device)
    out32 = torch.zeros((t, hq, d), dtype=torch.float32, device=q.device)
    lse2 = torch.empty((hq, t), dtype=torch.float32, device=q.device)
    grid = (hkv * blocks.num_blocks_bound,)
    common = dict(G=grp, GP=gp, QT=qt, BS=bs, D=d, FP32_DOT=INTERPRET,
                  num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"])
    args = (csr.offsets, csr.tokens, csr.order, blocks.block_doc, blocks.block_local,
            msa.cu_seqlens, blocks.token_pos,
            q_.stride(0), q_.stride(1), k_.stride(0), k_.stride(1), v_.stride(0), v_.stride(1),
            out32.stride(0), out32.stride(1), lse2.stride(0), n_entries,
            blocks.num_blocks_bound, scale * LOG2E)
    _kv_pass_kernel[grid](q_, k_, v_, lse2, m, lsum, out32, *args, PASS=1, **common)
    # Entry i of the sorted CSR came from flat (g, t, s) index order[i]; undo the sort.
    # Entries past the valid ones keep m = -inf, l = 0 (their slots were -1 or out of range).
    sort_idx = torch.sort(_csr_keys(q2k_, blocks, msa).reshape(-1), stable=True).indices
    inv = torch.empty_like(sort_idx)
    inv[sort_idx] = torch.arange(sort_idx.numel(), device=q.device)
    mm = m[:grp, inv].view(grp, hkv, t, top_k)
    ll = lsum[:grp, inv].view(grp, hkv, t, top_k)
    mx = mm.amax(-1, keepdim=True)
    mx_use = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)
    tot = (ll * torch.exp2(mm - mx_use)).sum(-1)
    l2 = torch.where(tot > 0, mx_use.squeeze(-1) + torch.log2(tot.clamp_min(1e-30)),
                     torch.full_like(tot, float("-inf")))
    lse2.copy_(l2.permute(1, 0, 2).reshape(hq, t))  # heads g * G + r
    del mm, ll, m, lsum
    _kv_pass_kernel[grid](q_, k_, v_, lse2, lse2, lse2, out32, *args, PASS=2, **common)
    return out32.to(q.dtype), lse2 * (1.0 / LOG2E)


def _csr_keys(q2k, blocks, msa):
    hkv, t, _ = q2k.shape
    bound = blocks.num_blocks_bound
    b = q2k.to(torch.int64)
    own = (blocks.token_pos.to(torch.int64) // blocks.block_size).view(1, t, 1)
    first = blocks.doc_first_block[msa.token_documents.to(torch.int64)].view(1, t, 1)
    head = torch.arange(hkv, device=q2k.device, dtype=torch.int64).view(hkv, 1, 1)
    valid = (b >= 0) & (b <= own)
    return torch.where(valid, head * bound + first + b, torch.full_like(b, hkv * bound))
