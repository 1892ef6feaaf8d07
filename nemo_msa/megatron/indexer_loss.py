"""The indexer's distillation loss, its autograd scaler and its logging.

Top-k selection has no gradient, so the indexer learns by distillation (MiniMax-M3 recipe, and
Megatron-Core's DSA indexer loss): for every query token t and KV head g,

- target ``P_g(t, b)``: the main attention's probability mass on key block b, summed over the
  query heads of group g and divided by their number (so it sums to 1), no gradient;
- prediction ``Q_g(t, b) = softmax_b(score_g(t, b) / sqrt(d_idx))`` over the candidate blocks of
  the query's document, score as in the selection (``"max"`` or ``"lse"`` of index_q . index_k
  over the block's causally visible keys);
- loss ``coeff * mean_{t, g} KL(P_g(t) || Q_g(t))``.

The indexer's input is detached by the indexer, and the target carries no gradient, so the loss
trains only the indexer. The target is the dense attention distribution whether the layer runs
sparse or dense, computed in query chunks with memory O(heads x chunk x tokens).

With ``sparse=True`` (``msa_indexer_loss_type="sparse"``) both distributions are restricted to
the blocks the layer selected and renormalized over them (as Megatron's DSA
``dsa_indexer_use_sparse_loss``): O(T x top_k x block) instead of O(T^2), the affordable choice
at long context; the dense warm-up (no selection) always uses the dense loss.

The loss is attached to the attention output with :class:`MSAIndexerLossAutoScaler` (identity in
the forward; in the backward it injects ``d loss = scale``), so Megatron's pipeline schedules
back-propagate it with the main loss. The schedules set the scale through
``config.experimental_attention_variant_loss_scale_func`` (``MSATransformerConfig`` points it at
:meth:`MSAIndexerLossAutoScaler.set_loss_scale`), exactly as for DSA.

The production path (sparse loss, score ``"max"``) needs no pass of its own:
:func:`sparse_indexer_loss_from_byproducts` takes the target from the sparse forward (the mass
per selected block, accumulated in its pass over K/V) and the prediction's scores and argmax keys
from the selection kernel, so the KL and its gradients cost O(T x H x top_k x d).
:func:`compute_indexer_loss` with ``sparse=True`` is its reference (query chunks that gather the
selected keys again and recompute both sides).

With tensor parallelism each rank computes the KL of its own KV/index heads divided by the
*global* head count, so the per-rank losses sum to the full loss and the gradients are exact
(see nemo_msa.megatron.indexer for the replicated parameters).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils.checkpoint import checkpoint

from nemo_msa.attention.naive import accumulation_dtype

__all__ = [
    "MSAIndexerLossAutoScaler",
    "MSAIndexerMetrics",
    "compute_indexer_loss",
    "sampled_selection_recall",
    "sparse_indexer_loss_from_byproducts",
]

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
    scores = torch.einsum("chd,wd->chw", index_q.to(work), index_k_ws.to(work)) * index_scale
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

    Returns:
        ``(loss, stats)``: loss is a scalar fp32 tensor, ``coeff * sum_local KL / (T * H)``;
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
        documents = msa.token_documents.long()
        positions = msa.document_positions.long()
        first_block = msa.token_workspace_block_starts  # [T]
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

    denominator = float(tokens * num_index_heads_total)
    kl = kl_total / denominator
    stats = {"kl": kl.detach()}
    if q2k is not None:
        stats["recall_mass"] = recall_mass
        stats["recall_count"] = torch.full((), float(tokens * heads), dtype=work, device=device)
    return kl * loss_coeff, stats


# Elements of one chunk's gathered key tile [C, H, top_k * B, d]; bounds the sparse loss memory.
_SPARSE_GATHER_ELEMENTS = 1 << 24


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
        positions = msa.document_positions.long()
        first_block = msa.token_workspace_block_starts
        offsets = torch.arange(block, device=device)
        head_index = torch.arange(heads, device=device)[None, :, None]
    index_k_ws = msa.to_workspace(index_k)
    chunk = max(1, _SPARSE_GATHER_ELEMENTS // (heads * top_k * block * max(head_dim, index_dim)))
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
    kl = kl_total / float(tokens * num_index_heads_total)
    return kl * loss_coeff, {"kl": kl.detach()}


# Elements of one chunk's gathered [H, C, top_k, d] rows in the by-product loss's backward.
_BYPRODUCT_GATHER_ELEMENTS = 1 << 25


class _SparseKLFromByproducts(torch.autograd.Function):
    """sum_{h,t} KL(P_h(t) || softmax(scale * s_h(t))) over the selected slots, divided by
    ``denominator``; differentiable in index_q and index_k through the argmax keys."""

    @staticmethod
    def forward(ctx, index_q, index_k, scores, keys, target, index_scale, denominator):
        work = accumulation_dtype(scores)
        log_q = torch.log_softmax(scores.to(work) * index_scale, dim=-1)  # -inf at -1 slots
        target = target.to(work)
        has_mass = target > 0
        terms = torch.where(
            has_mass, target * (torch.log(target.clamp_min(_EPS)) - log_q), torch.zeros_like(log_q)
        )
        ctx.save_for_backward(index_q, index_k, keys, target, log_q)
        ctx.index_scale = index_scale
        ctx.denominator = denominator
        return terms.sum() / denominator

    @staticmethod
    def backward(ctx, grad):
        index_q, index_k, keys, target, log_q = ctx.saved_tensors
        # d KL / d s_b = Q_b * sum(P) - P_b (sum(P) = 1 up to rounding; kept exact here).
        dscore = torch.exp(log_q) * target.sum(-1, keepdim=True) - target
        dscore = dscore * (grad.to(dscore.dtype) * ctx.index_scale / ctx.denominator)
        dq, dk = _gather_scatter_grads(dscore, keys, index_q, index_k)
        return dq, dk, None, None, None, None, None


def _gather_scatter_grads(dscore, keys, index_q, index_k):
    """d index_q by a gather of the argmax keys, d index_k by a scatter onto them.

    Args:
        dscore: fp32 [H, T, K] gradient of each slot's (scaled) block score.
        keys: int32 [H, T, K] compact row of each slot's argmax key, -1 at unused slots.
        index_q: [T, H, d]; index_k: [T, d].

    Returns:
        ``(d index_q [T, H, d], d index_k [T, d])`` in the inputs' dtypes. The scatter is
        ``index_add_``: deterministic on the CPU and, under
        ``torch.use_deterministic_algorithms(True)``, on CUDA (sort-based, no atomics).
    """
    heads, tokens, top_k = dscore.shape
    dim = index_q.shape[-1]
    work = accumulation_dtype(dscore)
    dq = torch.empty(tokens, heads, dim, dtype=work, device=index_q.device)
    dk = torch.zeros(tokens, dim, dtype=work, device=index_q.device)
    key_rows = index_k.to(work)
    chunk = max(1, _BYPRODUCT_GATHER_ELEMENTS // max(1, heads * top_k * dim))
    for start in range(0, tokens, chunk):
        stop = min(tokens, start + chunk)
        used = keys[:, start:stop] >= 0  # [H, C, K]
        rows = keys[:, start:stop].long().clamp(min=0)
        g = torch.where(used, dscore[:, start:stop].to(work), 0.0)
        gathered = key_rows[rows]  # [H, C, K, d]
        dq[start:stop] = torch.einsum("hck,hckd->chd", g, gathered)
        q_rows = index_q[start:stop].to(work).permute(1, 0, 2)  # [H, C, d]
        contrib = g[..., None] * q_rows[:, :, None, :]  # [H, C, K, d]
        dk.index_add_(0, rows.reshape(-1), contrib.reshape(-1, dim))
    return dq.to(index_q.dtype), dk.to(index_k.dtype)


def sparse_indexer_loss_from_byproducts(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    block_scores: torch.Tensor,
    block_keys: torch.Tensor,
    block_mass: torch.Tensor,
    *,
    num_index_heads_total: int,
    loss_coeff: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sparse indexer loss (score ``"max"``) from the selection's and the forward's by-products.

    The same function as ``compute_indexer_loss(..., sparse=True, score_type="max")``, with no
    pass over the keys: the target is the sparse forward's mass per selected slot and the
    prediction the softmax of the selected blocks' real scores.

    Args:
        index_q: [T, H_local, d_idx] index queries (with gradient).
        index_k: [T, d_idx] the shared index key (with gradient).
        block_scores: fp32 [H_local, T, top_k] unscaled block max of index_q . index_k per slot,
            -inf at -1 slots (``select_blocks(..., return_scores=True)``).
        block_keys: int32 [H_local, T, top_k] compact row of the key attaining each slot's max,
            -1 at -1 slots.
        block_mass: fp32 [H_local, T, top_k] the main attention's mean mass per slot over the
            group's query heads (``sparse_attention(..., return_block_mass=True)``).
        num_index_heads_total: index heads of the whole layer (all TP ranks).
        loss_coeff: msa_indexer_loss_coeff.

    Returns:
        ``(loss, stats)`` as :func:`compute_indexer_loss`: ``coeff * sum_local KL / (T * H)``
        and ``{"kl": ...}``.

    Raises:
        ValueError: by-products whose shapes disagree with ``index_q`` (named).
    """
    tokens, heads, index_dim = index_q.shape
    expected = (heads, tokens)
    for name, x in (("block_scores", block_scores), ("block_keys", block_keys),
                    ("block_mass", block_mass)):
        if x.dim() != 3 or tuple(x.shape[:2]) != expected:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; expected [index_heads={heads}, "
                f"tokens={tokens}, top_k] like index_q {tuple(index_q.shape)}"
            )
    if block_keys.shape != block_scores.shape or block_mass.shape != block_scores.shape:
        raise ValueError(
            f"block_scores {tuple(block_scores.shape)}, block_keys {tuple(block_keys.shape)} and "
            f"block_mass {tuple(block_mass.shape)} must have one shape"
        )
    denominator = float(tokens * num_index_heads_total)
    kl = _SparseKLFromByproducts.apply(
        index_q, index_k, block_scores, block_keys, block_mass.detach(),
        1.0 / math.sqrt(index_dim), denominator,
    )
    return kl * loss_coeff, {"kl": kl.detach()}


@contextlib.contextmanager
def _tf32_matmul(enabled: bool):
    """fp32 CUDA matmuls on TF32 tensor cores inside the block (restored after)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = previous or enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


# Elements of one chunk's [C, Hq, W] score tensor in the sampled recall.
_RECALL_SCORE_ELEMENTS = 1 << 26


@torch.no_grad()
def sampled_selection_recall(
    query: torch.Tensor,
    key: torch.Tensor,
    q2k: torch.Tensor,
    msa,
    *,
    softmax_scale: float,
    num_rows: int,
) -> dict[str, torch.Tensor]:
    """Selection recall measured exactly on a fixed-size sample of query tokens.

    Estimator: the tokens ``floor((i + 1/2) * T / n)``, ``i < n = min(num_rows, T)``, evenly
    spaced over the microbatch's compact tokens (a systematic sample: every part of every
    document is represented, and ``n = T`` gives the exact recall). For each sampled token and
    local KV head the dense attention's block mass (mean over the group's query heads, within
    the document, causal) is computed, and the mass inside the selected blocks is summed. The
    mean over sampled (token, head) pairs estimates the full mean; its cost is one dense pass
    over ``n`` query rows, O(n x Hq x T) in chunks. On CUDA the scores are fp32 products of
    TF32-rounded inputs (a metric: about 1e-3 relative; fp32 FFMA would cost about 11 ms per
    layer at 131072 tokens); elsewhere exact in the accumulation dtype.

    Args:
        query: [T, Hq_local, d] main-attention queries after RoPE.
        key: [T, Hkv_local, d] main-attention keys after RoPE.
        q2k: int32 [Hkv_local, T, top_k] the selected blocks.
        msa: the microbatch layout.
        softmax_scale: the main attention's scale.
        num_rows: sample size (>= 1).

    Returns:
        ``{"recall_mass": sum of covered mass, "recall_count": sampled (token, head) pairs}``,
        scalars (fp32; fp64 for fp64 inputs), as :func:`compute_indexer_loss` reports them.

    Raises:
        ValueError: ``num_rows`` < 1.
    """
    if num_rows < 1:
        raise ValueError(f"num_rows={num_rows}; expected >= 1")
    tokens, q_heads, dim = query.shape
    heads = key.shape[1]
    group = q_heads // heads
    block = msa.block_size
    nblocks = msa.num_workspace_blocks
    device = query.device
    n = min(num_rows, tokens)
    rows = ((torch.arange(n, device=device, dtype=torch.float64) + 0.5) * tokens / n).long()
    work = accumulation_dtype(query)
    key_ws = msa.to_workspace(key.detach().to(work))  # [W, G, d]
    key_documents = msa.workspace_documents
    key_positions = msa.workspace_positions_in_document
    documents = msa.token_documents.long()[rows]
    positions = msa.document_positions.long()[rows]
    first_block = msa.token_workspace_block_starts[rows]
    covered = torch.zeros((), dtype=work, device=device)
    chunk = max(1, _RECALL_SCORE_ELEMENTS // max(1, q_heads * msa.workspace_size))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        count = stop - start
        visible = (key_documents[None, :] == documents[start:stop, None]) & (
            key_positions[None, :] <= positions[start:stop, None]
        )
        qc = query[rows[start:stop]].detach().to(work).view(count, heads, group, dim)
        with _tf32_matmul(query.is_cuda and work == torch.float32):
            scores = torch.einsum("cgqd,wgd->cgqw", qc, key_ws) * softmax_scale
        scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
        probs = torch.softmax(scores, dim=-1).sum(dim=2) / group  # [C, G, W]
        target = probs.view(count, heads, nblocks, block).sum(dim=-1)  # [C, G, NB]
        selected = q2k[:, rows[start:stop]].long()  # [G, C, K]
        block_ids = first_block[start:stop][None, :, None] + selected.clamp(min=0)
        mass = target.permute(1, 0, 2).gather(-1, block_ids)
        covered += torch.where(selected >= 0, mass, 0.0).sum()
    return {
        "recall_mass": covered,
        "recall_count": torch.full((), float(n * heads), dtype=work, device=device),
    }


class MSAIndexerLossAutoScaler(torch.autograd.Function):
    """Attaches the indexer loss to an activation: identity forward, ``d loss = scale`` backward.

    ``main_loss_backward_scale`` is what Megatron's schedules set per microbatch (the loss scale
    divided by the number of microbatches) through ``set_loss_scale``; it is 1 until then, which
    is right for a loop that calls ``loss.backward()`` on one microbatch itself.
    """

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, indexer_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indexer_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indexer_loss,) = ctx.saved_tensors
        scale = MSAIndexerLossAutoScaler.main_loss_backward_scale
        if scale is None:
            grad_loss = torch.ones_like(indexer_loss)
        else:
            grad_loss = torch.ones_like(indexer_loss) * scale.to(indexer_loss.device)
        return grad_output, grad_loss

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Sets the backward scale of every attached indexer loss (called by the schedules).

        Args:
            scale: scalar tensor.

        Raises:
            TypeError: ``scale`` is not a tensor.
        """
        if not isinstance(scale, torch.Tensor):
            raise TypeError(
                f"MSAIndexerLossAutoScaler.set_loss_scale needs a torch.Tensor; got {type(scale)}"
            )
        scale = scale.detach().float()
        if MSAIndexerLossAutoScaler.main_loss_backward_scale is None:
            MSAIndexerLossAutoScaler.main_loss_backward_scale = scale.clone()
        else:
            MSAIndexerLossAutoScaler.main_loss_backward_scale.copy_(scale)

    @staticmethod
    def reset() -> None:
        """Forgets the scale (back to 1)."""
        MSAIndexerLossAutoScaler.main_loss_backward_scale = None


class MSAIndexerMetrics:
    """Per-layer accumulator of the indexer loss and the selection recall, for logging.

    Layers record every training microbatch; :meth:`pop` reduces over tensor-, pipeline- and
    data-parallel ranks and resets. Process-wide like Megatron's DSA/MoE loss trackers.
    Selection recall = mean over (token, KV head) of the main attention's block mass that the
    selected blocks cover (1.0 means the sparse layer sees everything dense attention would
    weigh).
    """

    # layer_number -> fp32 [4]: kl (TP-partial), recall mass (TP-partial), recall count
    # (TP-partial), microbatches (same on every TP rank).
    _values: dict[int, torch.Tensor] = {}

    @classmethod
    def record(cls, layer_number: int, stats: dict[str, torch.Tensor]) -> None:
        """Adds one microbatch of one layer."""
        kl = stats["kl"].detach().float()
        row = torch.stack(
            [
                kl,
                stats.get("recall_mass", torch.zeros_like(kl)).float(),
                stats.get("recall_count", torch.zeros_like(kl)).float(),
                torch.ones_like(kl),
            ]
        )
        if layer_number in cls._values:
            cls._values[layer_number] += row
        else:
            cls._values[layer_number] = row

    @classmethod
    def reset(cls) -> None:
        """Drops everything recorded."""
        cls._values = {}

    @classmethod
    def pop(cls, num_layers: int | None = None, reduce: bool = True) -> dict[str, float]:
        """Reduced metrics of everything recorded since the last pop, then reset.

        Every rank of the model must call it (it runs collectives when ``reduce`` and
        torch.distributed is initialized).

        Args:
            num_layers: total layers of the model (default: the largest recorded layer number,
                which must then be the same on all ranks; pass it with pipelining).
            reduce: all-reduce over TP (sum of shares), PP (layers live on one stage) and DP
                (average).

        Returns:
            ``{"indexer_loss": mean KL over MSA layers and microbatches (without the
            coefficient), "selection_recall": mean recall, "indexer_loss/layer_<n>": ...,
            "selection_recall/layer_<n>": ...}``; empty when no rank recorded anything.
        """
        values = cls._values
        cls._values = {}
        if num_layers is None:
            num_layers = max(values) if values else 0
        device = next(iter(values.values())).device if values else torch.device("cpu")
        table = torch.zeros(num_layers, 4, dtype=torch.float32, device=device)
        for layer_number, row in values.items():
            table[layer_number - 1] += row.to(device)
        if reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
            table = _reduce_table(table)
        present = table[:, 3] > 0
        if not bool(present.any()):
            return {}
        micro = table[:, 3].clamp_min(1.0)
        kl = table[:, 0] / micro
        recall = table[:, 1] / table[:, 2].clamp_min(1.0)
        has_recall = present & (table[:, 2] > 0)
        out = {"indexer_loss": float(kl[present].mean())}
        if bool(has_recall.any()):
            out["selection_recall"] = float(recall[has_recall].mean())
        for index in torch.nonzero(present).flatten().tolist():
            out[f"indexer_loss/layer_{index + 1}"] = float(kl[index])
            if bool(has_recall[index]):
                out[f"selection_recall/layer_{index + 1}"] = float(recall[index])
        return out


def _reduce_table(table: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return table
    dist = torch.distributed
    shares, micro = table[:, :3].contiguous(), table[:, 3:].contiguous()
    dist.all_reduce(shares, group=parallel_state.get_tensor_model_parallel_group())
    dist.all_reduce(
        micro, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
    )
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    dist.all_reduce(shares, group=pp_group)
    dist.all_reduce(micro, group=pp_group)
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False)
    if dist.get_world_size(dp_group) > 1:
        # Average the per-layer ratios' ingredients across data-parallel replicas.
        dist.all_reduce(shares, group=dp_group)
        dist.all_reduce(micro, group=dp_group)
    return torch.cat([shares, micro], dim=1)
