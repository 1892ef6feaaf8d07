"""The indexer's distillation loss, plain PyTorch: the reference of every fused path.

Top-k selection has no gradient, so the indexer learns by distillation (MiniMax-M3 recipe, and
Megatron-Core's DSA indexer loss): for every query token t and KV head g,

- target ``P_g(t, b)``: the main attention's probability mass on key block b, summed over the
  query heads of group g and divided by their number (so it sums to 1), no gradient;
- prediction ``Q_g(t, b) = softmax_b(score_g(t, b) / sqrt(d_idx))`` over the candidate blocks of
  the query's document, score as in the selection (``"max"`` or ``"lse"`` of index_q . index_k
  over the block's causally visible keys);
- loss ``coeff * mean_{t, g} KL(P_g(t) || Q_g(t))``.

The target is the dense attention distribution whether the layer runs sparse or dense, computed
here in query chunks with memory O(heads x chunk x tokens); the index side of each chunk is
recomputed in the backward (activation checkpointing) instead of kept.

With ``sparse=True`` (``msa_indexer_loss_type="sparse"``) both distributions are restricted to
the blocks the layer selected and renormalized over them (as Megatron's DSA
``dsa_indexer_use_sparse_loss``): O(T x top_k x block) instead of O(T^2).

With tensor parallelism each rank computes the KL of its own KV/index heads divided by the
*global* head count, so the per-rank losses sum to the full loss and the gradients are exact.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from nemo_msa.layout import query_rows
from nemo_msa.limits import accumulation_dtype

__all__ = ["compute_indexer_loss"]

_EPS = 1e-10


def _index_block_log_probs(
    index_q: torch.Tensor,
    index_k_ws: torch.Tensor,
    visible: torch.Tensor,
    block_size: int,
    index_scale: float,
    score_type: str,
) -> torch.Tensor:
    """log Q [C, H, NB] for a query chunk; -inf on blocks that hold no visible key."""
    work = accumulation_dtype(index_q)
    # The chunk's queries share the window's keys: a NaN/Inf key would reach the d index_q of
    # queries that do not see it (0 * NaN in the einsum's backward). The product runs on finite
    # keys and the pairs that see a non-finite key get NaN scores.
    finite = torch.isfinite(index_k_ws).all(-1)  # [W]
    keys = index_k_ws.masked_fill(~finite[:, None], 0.0).to(work)
    scores = torch.einsum("chd,wd->chw", index_q.to(work), keys) * index_scale
    scores = scores.masked_fill((visible & ~finite[None, :])[:, None, :], math.nan)
    scores = scores.masked_fill(~visible[:, None, :], -math.inf)
    chunk, heads, width = scores.shape
    blocks = scores.view(chunk, heads, width // block_size, block_size)
    if score_type == "max":
        block_scores = blocks.amax(dim=-1)
    else:
        block_scores = torch.logsumexp(blocks, dim=-1)
    return torch.log_softmax(block_scores, dim=-1)


def _chunk_kl(
    index_q: torch.Tensor,
    index_k_ws: torch.Tensor,
    visible: torch.Tensor,
    target: torch.Tensor,
    block_size: int,
    index_scale: float,
    score_type: str,
) -> torch.Tensor:
    log_q = _index_block_log_probs(
        index_q, index_k_ws, visible, block_size, index_scale, score_type
    )
    has_mass = target > 0
    # Blocks without target mass contribute 0 (and must not turn 0 * -inf into NaN).
    terms = torch.where(
        has_mass, target * (torch.log(target.clamp_min(_EPS)) - log_q), torch.zeros_like(log_q)
    )
    return terms.sum()


def compute_indexer_loss(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    msa,
    *,
    softmax_scale: float,
    num_index_heads_total: int,
    loss_coeff: float,
    score_type: str = "max",
    q2k: torch.Tensor | None = None,
    query_chunk: int = 1024,
    sparse: bool = False,
    queries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's share of the indexer KL loss of one layer and microbatch.

    Args:
        index_q: [T, H_local, d_idx] index queries (with gradient).
        index_k: [T, d_idx] the shared index key (with gradient).
        query: [T, Hq_local, d] main-attention queries after RoPE (detached here).
        key: [T, H_local, d] main-attention keys after RoPE (detached here).
        msa: the microbatch layout.
        softmax_scale: the main attention's scale.
        num_index_heads_total: index heads of the whole layer (all TP ranks).
        loss_coeff: msa_indexer_loss_coeff.
        score_type: "max" or "lse", as the selection.
        q2k: optional int32 [H_local, T, top_k] selected blocks: the selection recall (dense
            loss) or the support of the sparse loss.
        query_chunk: query tokens per chunk (dense loss; the sparse loss sizes its own chunks).
        sparse: restrict target and prediction to the selected blocks (both renormalized over
            them), O(T x top_k x block) instead of O(T^2); needs ``q2k``; no recall then.
        queries: optional int64 [Tq] global compact rows of the query-side tensors' tokens (a
            query subset: context parallelism). index_q, query and q2k then have Tq rows,
            index_k and key every token's; the KL is still divided by the layout's (global)
            token count, so the ranks' losses add up to the unsplit loss.

    Returns:
        ``(loss, stats)``: loss is a scalar fp32 tensor, ``coeff * sum_local KL / (T * H)``
        (T the layout's num_tokens);
        stats holds detached fp32 scalars ``kl`` (the same without coeff), ``recall_mass`` and
        ``recall_count`` (sum over local heads and tokens of the target mass inside the selected
        blocks, and how many (token, head) pairs that sums; absent without q2k).
    """
    if sparse:
        if q2k is None:
            raise ValueError("the sparse indexer loss needs q2k (the selected blocks); got None")
        return _sparse_indexer_loss(
            index_q,
            index_k,
            query,
            key,
            msa,
            q2k,
            softmax_scale=softmax_scale,
            num_index_heads_total=num_index_heads_total,
            loss_coeff=loss_coeff,
            score_type=score_type,
            queries=queries,
        )
    tokens, heads, index_dim = index_q.shape
    q_heads = query.shape[1]
    group = q_heads // key.shape[1]
    block = msa.block_size
    nblocks = msa.num_workspace_blocks
    index_scale = 1.0 / math.sqrt(index_dim)
    device = index_q.device
    work = accumulation_dtype(query)

    with torch.no_grad():
        key_ws = msa.to_workspace(key.detach().to(work))  # [W, G, d]
        key_documents = msa.workspace_documents  # [W], -1 past document ends
        key_positions = msa.workspace_positions_in_document  # [W]
        documents = query_rows(msa.token_documents, queries).long()
        positions = query_rows(msa.document_positions, queries).long()
        first_block = query_rows(msa.token_workspace_block_starts, queries)  # [T] or [Tq]
    # Differentiable placement of index_k into the workspace (index_copy has a gradient).
    index_k_ws = msa.to_workspace(index_k)

    kl_total = torch.zeros((), dtype=work, device=device)
    recall_mass = torch.zeros((), dtype=work, device=device)
    for start in range(0, tokens, query_chunk):
        stop = min(tokens, start + query_chunk)
        count = stop - start
        with torch.no_grad():
            visible = (key_documents[None, :] == documents[start:stop, None]) & (
                key_positions[None, :] <= positions[start:stop, None]
            )  # [C, W]; every query sees at least itself
            qc = query[start:stop].detach().to(work).view(count, heads, group, -1)
            scores = torch.einsum("cgqd,wgd->cgqw", qc, key_ws) * softmax_scale
            scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
            probs = torch.softmax(scores, dim=-1).sum(dim=2) / group  # [C, G, W]
            target = probs.view(count, heads, nblocks, block).sum(dim=-1)  # [C, G, NB]
        args = (index_q[start:stop], index_k_ws, visible, target, block, index_scale, score_type)
        if torch.is_grad_enabled() and (index_q.requires_grad or index_k.requires_grad):
            # Recompute the [C, H, W] index scores in the backward instead of keeping them.
            kl_total = kl_total + checkpoint(_chunk_kl, *args, use_reentrant=False)
        else:
            kl_total = kl_total + _chunk_kl(*args)
        if q2k is not None:
            with torch.no_grad():
                selected = q2k[:, start:stop].long()  # [G, C, K]
                block_ids = first_block[start:stop][None, :, None] + selected.clamp(min=0)
                mass = target.permute(1, 0, 2).gather(-1, block_ids)  # [G, C, K]
                recall_mass += torch.where(selected >= 0, mass, 0.0).sum()

    denominator = float(msa.num_tokens * num_index_heads_total)
    kl = kl_total / denominator
    stats = {"kl": kl.detach()}
    if q2k is not None:
        stats["recall_mass"] = recall_mass
        stats["recall_count"] = torch.full((), float(tokens * heads), dtype=work, device=device)
    return kl * loss_coeff, stats


# Elements of one chunk's gathered key tile [C, H, top_k * B, d] at most (fp32: 1 GiB, with
# about four tiles' worth live in a chunk); the host keeps the small tiles it always had.
_SPARSE_GATHER_ELEMENTS = 1 << 28
_SPARSE_GATHER_ELEMENTS_HOST = 1 << 24
# Share of the device's free memory the chunk's tiles may take.
_SPARSE_FREE_SHARE = 0.25


def _sparse_chunk_tokens(per_token: int, work: torch.dtype, device: torch.device) -> int:
    """Query tokens per chunk of the sparse reference, sized by memory: as many as fit
    :data:`_SPARSE_GATHER_ELEMENTS` and a quarter of the device's free memory over the chunk's
    ~4 live tiles of ``per_token`` elements on CUDA (a 16-token loop at MiniMax-M3's shape would
    be launch-bound), :data:`_SPARSE_GATHER_ELEMENTS_HOST` elsewhere."""
    budget = _SPARSE_GATHER_ELEMENTS_HOST
    if device.type == "cuda":
        budget = _SPARSE_GATHER_ELEMENTS
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, int(free * _SPARSE_FREE_SHARE) // (4 * work.itemsize))
    return max(1, budget // max(1, per_token))


def _sparse_chunk_kl(
    index_q: torch.Tensor,
    index_k_ws: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor,
    target: torch.Tensor,
    index_scale: float,
    score_type: str,
) -> torch.Tensor:
    """KL over the selected blocks of a chunk: index_q [C, H, d], rows/visible [C, H, K, B]."""
    count, heads, top_k, block = rows.shape
    work = accumulation_dtype(index_q)
    keys = index_k_ws[rows.reshape(count, heads, top_k * block)].to(work)  # [C, H, K*B, d]
    # Each query has its own gathered keys: zeroing those it does not see is exact (no 0 * NaN).
    keys = keys.masked_fill(~visible.reshape(count, heads, top_k * block, 1), 0.0)
    scores = torch.einsum("chd,chnd->chn", index_q.to(work), keys) * index_scale
    scores = scores.view(count, heads, top_k, block).masked_fill(~visible, -math.inf)
    if score_type == "max":
        block_scores = scores.amax(dim=-1)
    else:
        block_scores = torch.logsumexp(scores, dim=-1)
    log_q = torch.log_softmax(block_scores, dim=-1)  # -inf at unused (-1) slots
    has_mass = target > 0
    terms = torch.where(
        has_mass, target * (torch.log(target.clamp_min(_EPS)) - log_q), torch.zeros_like(log_q)
    )
    return terms.sum()


def _sparse_indexer_loss(
    index_q,
    index_k,
    query,
    key,
    msa,
    q2k,
    *,
    softmax_scale,
    num_index_heads_total,
    loss_coeff,
    score_type,
    queries=None,
):
    tokens, heads, index_dim = index_q.shape
    group = query.shape[1] // key.shape[1]
    top_k = q2k.shape[-1]
    block = msa.block_size
    head_dim = query.shape[-1]
    index_scale = 1.0 / math.sqrt(index_dim)
    device = index_q.device
    work = accumulation_dtype(query)
    with torch.no_grad():
        key_ws = msa.to_workspace(key.detach().to(work))  # [W, G, d]
        positions = query_rows(msa.document_positions, queries).long()
        first_block = query_rows(msa.token_workspace_block_starts, queries)
        offsets = torch.arange(block, device=device)
        head_index = torch.arange(heads, device=device)[None, :, None]
    index_k_ws = msa.to_workspace(index_k)
    chunk = _sparse_chunk_tokens(heads * top_k * block * max(head_dim, index_dim), work, device)
    kl_total = torch.zeros((), dtype=work, device=device)
    for start in range(0, tokens, chunk):
        stop = min(tokens, start + chunk)
        count = stop - start
        with torch.no_grad():
            selected = q2k[:, start:stop].permute(1, 0, 2).long()  # [C, H, K]
            used = selected >= 0
            local = selected.clamp(min=0)
            rows = (first_block[start:stop, None, None] + local)[..., None] * block + offsets
            visible = used[..., None] & (
                local[..., None] * block + offsets <= positions[start:stop, None, None, None]
            )  # [C, H, K, B]
            flat_rows = rows.reshape(count, heads, top_k * block)
            keys = key_ws[flat_rows, head_index]  # [C, H, K*B, d]
            qc = query[start:stop].detach().to(work).view(count, heads, group, head_dim)
            scores = torch.einsum("chqd,chnd->chqn", qc, keys) * softmax_scale
            scores = scores.masked_fill(~visible.reshape(count, heads, 1, -1), -math.inf)
            probs = torch.softmax(scores, dim=-1).sum(dim=2) / group  # [C, H, K*B]
            target = probs.view(count, heads, top_k, block).sum(dim=-1)  # [C, H, K]
        args = (index_q[start:stop], index_k_ws, rows, visible, target, index_scale, score_type)
        if torch.is_grad_enabled() and (index_q.requires_grad or index_k.requires_grad):
            kl_total = kl_total + checkpoint(_sparse_chunk_kl, *args, use_reentrant=False)
        else:
            kl_total = kl_total + _sparse_chunk_kl(*args)
    kl = kl_total / float(msa.num_tokens * num_index_heads_total)
    return kl * loss_coeff, {"kl": kl.detach()}


