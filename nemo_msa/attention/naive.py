"""Reference sparse attention in plain PyTorch: forward, backward, and dense oracles.

``out(p, hq) = sum_j softmax_j(q(p, hq) . k(j, g) * scale) v(j, g)`` over the keys j of the
blocks that ``q2k[g, p]`` selects in the query's document, with j <= p and g = hq // (Hq / Hkv).

Any q2k means its set (MSA_SPEC.md): for each (KV head, token) the distinct entries that are
document-local block ids in 0..own block. Both passes first bring q2k to the canonical form
(:func:`canonical_q2k`: ascending, deduplicated, -1 at the tail), so order, duplicates, -1 and
out-of-range ids (even past the workspace) do not change the result.

Forward and backward work on the compact layout, chunked over queries, gathering the selected
key blocks from the aligned workspace; dk/dv accumulate into workspace blocks with index_add_
(deterministic on the CPU, and on CUDA under torch.use_deterministic_algorithms). Peak memory is
O(chunk x Hkv x top_k x block x d), never [T, T].
"""

from __future__ import annotations

import math

import torch

from nemo_msa.layout import MSAMicrobatch, query_rows
from nemo_msa.limits import accumulation_dtype
from nemo_msa.q2k import canonical_q2k

# Elements of one chunk's gathered K (or V) tile [C, Hkv, top_k * B, d]; bounds peak memory.
_GATHER_ELEMENTS_PER_CHUNK = 1 << 24


def _chunk_size(msa: MSAMicrobatch, kv_heads: int, top_k: int, dim: int) -> int:
    per_token = kv_heads * top_k * msa.block_size * dim
    return max(1, _GATHER_ELEMENTS_PER_CHUNK // per_token)


def _gather_blocks(
    msa: MSAMicrobatch,
    q2k: torch.Tensor,
    start: int,
    stop: int,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    queries: torch.Tensor | None = None,
):
    """Gathers the selected blocks of a query chunk and their visibility mask.

    Args:
        queries: optional int64 [Tq] global compact rows of the query tokens.
        k_blocks, v_blocks: [NB * Hkv, B, d], row ``block * Hkv + head`` (from
            :func:`_workspace_blocks`).

    Returns:
        ``(k, v, visible, rows)``: k and v [C, Hkv, top_k * B, d] (0 at the keys a query
        does not see), visible bool
        [C, Hkv, top_k * B], rows int64 [C, Hkv, top_k] (rows of ``k_blocks``; meaningful where
        a block is selected).
    """
    block = msa.block_size
    dim = k_blocks.shape[-1]
    selected = q2k[:, start:stop].permute(1, 0, 2).long()  # [C, Hkv, K]
    chunk, kv_heads, top_k = selected.shape
    first = query_rows(msa.token_workspace_block_starts, queries)[start:stop]  # [C]
    heads = torch.arange(kv_heads, device=q2k.device)[None, :, None]
    rows = (first[:, None, None] + selected.clamp(min=0)) * kv_heads + heads  # [C, Hkv, K]
    flat = rows.reshape(-1)
    k = k_blocks.index_select(0, flat).view(chunk, kv_heads, top_k * block, dim)
    v = v_blocks.index_select(0, flat).view(chunk, kv_heads, top_k * block, dim)
    positions = query_rows(msa.document_positions, queries)[start:stop].long()
    key_positions = selected[..., None] * block + torch.arange(block, device=q2k.device)
    visible = (selected[..., None] >= 0) & (key_positions <= positions[:, None, None, None])
    visible = visible.reshape(chunk, kv_heads, top_k * block)
    # Each query has its own gathered copy, so zeroing the keys it does not see is exact: a
    # NaN/Inf there would otherwise meet a zero probability (0 * NaN) in P V, dS K or dO V^T.
    hidden = ~visible[..., None]
    return k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0), visible, rows


def _workspace_blocks(msa: MSAMicrobatch, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, Hkv, d] -> [NB * Hkv, B, d] in ``dtype`` (row block * Hkv + head), zero past ends."""
    w = msa.to_workspace(x.to(dtype))
    blocks = w.view(msa.num_workspace_blocks, msa.block_size, *x.shape[1:])
    return blocks.transpose(1, 2).reshape(-1, msa.block_size, x.shape[-1])


def _trim_unused_slots(q2k: torch.Tensor, msa: MSAMicrobatch) -> torch.Tensor:
    """Drops trailing top-k slots no query can fill: a document has at most
    ceil(max_seqlen / B) blocks, so later slots are -1 everywhere (canonical order, which
    :func:`canonical_q2k` gives)."""
    usable = -(-msa.max_seqlen // msa.block_size)
    return q2k[..., : min(q2k.shape[-1], usable)]


def _from_workspace_blocks(msa: MSAMicrobatch, blocks: torch.Tensor, kv_heads: int):
    """[NB * Hkv, B, d] -> compact [T, Hkv, d]."""
    dim = blocks.shape[-1]
    w = blocks.view(msa.num_workspace_blocks, kv_heads, msa.block_size, dim).transpose(1, 2)
    return msa.from_workspace(w.reshape(msa.workspace_size, kv_heads, dim))


def sparse_attention_forward_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q2k: torch.Tensor,
    msa: MSAMicrobatch,
    softmax_scale: float,
    return_block_mass: bool = False,
    queries: torch.Tensor | None = None,
):
    """Sparse attention forward over selected blocks.

    Args:
        q: [T, Hq, d] float ([Tq, Hq, d] with ``queries``).
        k: [T, Hkv, d] float, same dtype as q (always every token).
        v: [T, Hkv, d] float, same dtype as q.
        q2k: int32 [Hkv, T, top_k] document-local block ids (-1 = none); any order,
            duplicates and out-of-range ids allowed (set semantics, see the module docstring).
        msa: layout.
        softmax_scale: multiplies q.k before the softmax.
        return_block_mass: also return the attention mass per selected slot [Hkv, T, top_k]
            (fp32, fp64 for fp64 inputs): the softmax probability of the slot's keys summed,
            averaged over the group's query heads; 0 at -1 slots.
        queries: optional int64 [Tq], the global compact rows of q's tokens (a query subset,
            ascending; context parallelism); q2k and the outputs then have Tq rows.

    Returns:
        ``(out [T, Hq, d] in q's dtype, lse fp32-or-fp64 [Hq, T])``; a query with no visible
        key gets zeros and lse = -inf. With ``return_block_mass`` the mass follows.
    """
    tokens, q_heads, dim = q.shape
    full_top_k = q2k.shape[-1]
    q2k = _trim_unused_slots(canonical_q2k(q2k, msa, queries), msa)
    kv_heads, _, top_k = q2k.shape
    group = q_heads // kv_heads
    dtype = accumulation_dtype(q)
    k_blocks = _workspace_blocks(msa, k, dtype)
    v_blocks = _workspace_blocks(msa, v, dtype)
    out = torch.empty(tokens, q_heads, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(q_heads, tokens, dtype=dtype, device=q.device)
    if return_block_mass:
        # Slots trimmed away (no document has that many blocks) hold no mass.
        mass = torch.zeros(kv_heads, tokens, full_top_k, dtype=dtype, device=q.device)
    chunk = _chunk_size(msa, kv_heads, top_k, dim)
    for start in range(0, tokens, chunk):
        stop = min(tokens, start + chunk)
        kc, vc, visible, _ = _gather_blocks(msa, q2k, start, stop, k_blocks, v_blocks, queries)
        qc = q[start:stop].to(dtype).view(stop - start, kv_heads, group, dim)
        scores = torch.matmul(qc, kc.transpose(-1, -2)) * softmax_scale  # [C, Hkv, G, n]
        scores = scores.masked_fill(~visible[:, :, None, :], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [C, Hkv, G]
        probs = torch.exp(scores - row_lse[..., None].nan_to_num(neginf=0.0))
        oc = torch.matmul(probs, vc)
        out[start:stop] = oc.reshape(stop - start, q_heads, dim).to(q.dtype)
        lse[:, start:stop] = row_lse.reshape(stop - start, q_heads).transpose(0, 1)
        if return_block_mass:
            per_slot = probs.view(stop - start, kv_heads, group, top_k, -1).sum(-1).mean(2)
            mass[:, start:stop, :top_k] = per_slot.transpose(0, 1)
    return (out, lse, mass) if return_block_mass else (out, lse)


def sparse_attention_backward_reference(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q2k: torch.Tensor,
    msa: MSAMicrobatch,
    softmax_scale: float,
    queries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention backward: recompute probabilities per chunk, accumulate dk/dv per block.

    Args:
        dout: [T, Hq, d] gradient of the output ([Tq, Hq, d] with ``queries``).
        q, k, v, q2k, msa, softmax_scale, queries: as in the forward.
        out: [T, Hq, d] forward output.
        lse: [Hq, T] forward log-sum-exp.

    Returns:
        ``(dq [T, Hq, d], dk [T, Hkv, d], dv [T, Hkv, d])`` in the inputs' dtypes; with
        ``queries`` dq has Tq rows and dk/dv (every token) hold the local queries' share only.
    """
    tokens, q_heads, dim = q.shape
    q2k = _trim_unused_slots(canonical_q2k(q2k, msa, queries), msa)
    kv_heads, _, top_k = q2k.shape
    group = q_heads // kv_heads
    block = msa.block_size
    dtype = accumulation_dtype(q)
    k_blocks = _workspace_blocks(msa, k, dtype)
    v_blocks = _workspace_blocks(msa, v, dtype)
    dk_blocks = torch.zeros_like(k_blocks)
    dv_blocks = torch.zeros_like(v_blocks)
    dq = torch.empty_like(q)
    # delta = rowsum(dO * O): the softmax-Jacobian term, computed once.
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1)  # [T, Hq]
    chunk = _chunk_size(msa, kv_heads, top_k, dim)
    for start in range(0, tokens, chunk):
        stop = min(tokens, start + chunk)
        count = stop - start
        kc, vc, visible, rows = _gather_blocks(
            msa, q2k, start, stop, k_blocks, v_blocks, queries
        )
        qc = q[start:stop].to(dtype).view(count, kv_heads, group, dim)
        doc = dout[start:stop].to(dtype).view(count, kv_heads, group, dim)
        lse_c = lse[:, start:stop].transpose(0, 1).reshape(count, kv_heads, group).to(dtype)
        scores = torch.matmul(qc, kc.transpose(-1, -2)) * softmax_scale
        scores = scores.masked_fill(~visible[:, :, None, :], -math.inf)
        probs = torch.exp(scores - lse_c[..., None].nan_to_num(neginf=0.0))
        dprobs = torch.matmul(doc, vc.transpose(-1, -2))
        delta_c = delta[start:stop].view(count, kv_heads, group, 1)
        # A hidden pair has probability 0 but the row's delta may be NaN (a row that attends
        # a NaN): 0 * NaN must not reach the dk of a key the row does not see.
        dscores = torch.where(
            visible[:, :, None, :], probs * (dprobs - delta_c) * softmax_scale, 0.0
        )
        dq[start:stop] = torch.matmul(dscores, kc).reshape(count, q_heads, dim).to(q.dtype)
        dk_c = torch.matmul(dscores.transpose(-1, -2), qc)  # [C, Hkv, n, d]
        dv_c = torch.matmul(probs.transpose(-1, -2), doc)
        # Unselected slots (-1) point at a real block but carry exact zeros.
        flat = rows.reshape(-1)
        dk_blocks.index_add_(0, flat, dk_c.reshape(-1, block, dim))
        dv_blocks.index_add_(0, flat, dv_c.reshape(-1, block, dim))
    return (
        dq,
        _from_workspace_blocks(msa, dk_blocks, kv_heads).to(k.dtype),
        _from_workspace_blocks(msa, dv_blocks, kv_heads).to(v.dtype),
    )


def masked_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    msa: MSAMicrobatch,
    softmax_scale: float | None = None,
    q2k: torch.Tensor | None = None,
    queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within documents over an explicit [T, T] mask, through plain autograd ops.

    The oracle of the sparse op (pass ``q2k`` to restrict keys to the selected blocks) and the
    dense path for small models (dense layers of a mixed pattern, the dense warm-up). Memory is
    O(Hq x Tq x T): meant for tests and small sequences.

    Args:
        q: [T, Hq, d] float ([Tq, Hq, d] with ``queries``).
        k: [T, Hkv, d] float (always every token).
        v: [T, Hkv, d] float.
        msa: layout.
        softmax_scale: defaults to 1 / sqrt(d).
        q2k: optional int32 [Hkv, T, top_k] ([Hkv, Tq, top_k]); when given only the selected
            blocks are visible.
        queries: optional int64 [Tq] global compact rows of q's tokens (a query subset).

    Returns:
        [T, Hq, d] ([Tq, Hq, d]) in q's dtype (computed in fp32, or fp64 for fp64 inputs).
    """
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    dtype = accumulation_dtype(q)
    visible = document_causal_mask(msa, queries)[None].expand(kv_heads, -1, -1)  # [Hkv, Tq, T]
    if q2k is not None:
        visible = visible & selected_key_mask(msa, q2k)
    qf = q.to(dtype).view(tokens, kv_heads, group, dim)
    scores = torch.einsum("tgqd,sgd->gqts", qf, k.to(dtype)) * scale
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    out = torch.einsum("gqts,sgd->tgqd", probs, v.to(dtype))
    return out.reshape(tokens, q_heads, dim).to(q.dtype)


def document_causal_mask(msa: MSAMicrobatch, queries: torch.Tensor | None = None) -> torch.Tensor:
    """bool [T, T] ([Tq, T] with ``queries``): query i sees key j when both are in one document
    and j <= i."""
    docs = msa.token_documents
    positions = msa.document_positions
    query_docs, query_positions = query_rows(docs, queries), query_rows(positions, queries)
    return (query_docs[:, None] == docs[None, :]) & (positions[None, :] <= query_positions[:, None])


def selected_key_mask(msa: MSAMicrobatch, q2k: torch.Tensor) -> torch.Tensor:
    """bool [Hkv, Tq, T]: key j lies in a block that query i selected for KV head g (q2k
    [Hkv, Tq, top_k]; a query only sees its own document's keys through the causal mask)."""
    key_blocks = (msa.document_positions.long() // msa.block_size)[None, None, :]  # [1, 1, T]
    chosen = q2k.long()  # [Hkv, T, K]
    return (chosen[..., None] == key_blocks[..., None, :]).any(dim=2)
