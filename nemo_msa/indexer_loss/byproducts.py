"""The sparse indexer loss (score ``"max"``) from the attention's by-product, with no pass over
the main attention's keys.

The target is the sparse forward's mass per selected block (accumulated in its pass over K/V),
the prediction the softmax of the selected blocks' real scores, which one block-major pass over
the selected slots finds with each block's argmax key (ADR 0033), so the KL and its gradients
cost O(T x H x top_k x block x d_idx): d index_q is a gather of the argmax keys, d index_k a
deterministic sum onto them.
:func:`nemo_msa.indexer_loss.naive.compute_indexer_loss` with ``sparse=True`` is its reference.
"""

from __future__ import annotations

import math

import torch

from nemo_msa import unplanned
from nemo_msa.backends.capabilities import TRITON_HELPERS
from nemo_msa.indexer_loss.triton_byproducts import (
    block_scores_triton,
    byproduct_grads_triton,
    sparse_kl_forward_triton,
)
from nemo_msa.layout import query_rows
from nemo_msa.limits import accumulation_dtype
from nemo_msa.triton.kernel_layout import kernels_run_on

__all__ = [
    "block_scores_reference",
    "sparse_indexer_loss_from_byproducts",
    "sparse_kl_forward_reference",
]

_EPS = 1e-10

# Elements of one chunk's gathered [H, C, top_k, d] rows in the by-product loss's backward.
_BYPRODUCT_GATHER_ELEMENTS = 1 << 25
# Elements of one chunk's gathered [H, C, top_k, block, d] keys when the block scores are found.
_ARGMAX_GATHER_ELEMENTS = 1 << 24


class _SparseKLFromByproducts(torch.autograd.Function):
    """sum_{h,t} KL(P_h(t) || softmax(scale * s_h(t))) over the selected slots (``q2k``),
    divided by ``denominator``, s_h(t) each selected block's score; differentiable in index_q
    and index_k through each block's argmax key.

    Where the kernels run (:func:`_fused`), the forward is two Triton passes (the block scores
    with their keys, then the KL with the unit score gradient) and the backward scales that
    gradient inside its kernels: nothing of the forward is recomputed and no elementwise kernel
    runs around them. Elsewhere the same function in torch (:func:`block_scores_reference`,
    :func:`sparse_kl_forward_reference`).
    """

    @staticmethod
    def forward(ctx, index_q, index_k, q2k, target, msa, queries, index_scale, denominator,
                fused):
        ctx.plan = None
        if _fused(target, index_q, fused):
            scores, keys, ctx.plan = block_scores_triton(index_q, index_k, q2k, msa, queries)
            row_kl, unit = sparse_kl_forward_triton(scores, target, index_scale, _EPS)
        else:
            scores, keys = block_scores_reference(index_q, index_k, q2k, msa, queries)
            row_kl, unit = sparse_kl_forward_reference(scores, target, index_scale, _EPS)
        ctx.save_for_backward(index_q, index_k, keys, unit)
        ctx.msa = msa
        ctx.denominator = denominator
        return row_kl.sum() / denominator

    @staticmethod
    def backward(ctx, grad):
        index_q, index_k, keys, unit = ctx.saved_tensors
        # d KL / d s_b = (Q_b * sum(P) - P_b) * scale, times d loss / d KL.
        factor = grad.to(unit.dtype) / ctx.denominator
        if ctx.plan is not None:
            dq, dk = byproduct_grads_triton(unit, keys, index_q, index_k, ctx.msa, ctx.plan,
                                            factor=factor)
        else:
            dq, dk = _gather_scatter_grads(unit * factor, keys, index_q, index_k)
        return dq, dk, None, None, None, None, None, None, None


def sparse_kl_forward_reference(
    scores: torch.Tensor, target: torch.Tensor, scale: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's KL of the by-product loss and its unit score gradient, in torch (the
    reference of :func:`nemo_msa.indexer_loss.triton_byproducts.sparse_kl_forward_triton`).

    Args:
        scores: [H, T, K] unscaled block scores, -inf at unused slots (fp32; fp64 stays fp64).
        target: [H, T, K] target mass per slot (0 at unused slots).
        scale: the index softmax scale (1 / sqrt(d_idx)).
        eps: the floor of ``P`` inside ``log P`` (only slots with ``P > 0`` count).

    Returns:
        ``(kl [H, T], unit [H, T, K])`` in the accumulation dtype (fp32, or fp64 for fp64
        scores): ``kl[h, t] = sum_k P log(P / Q)`` over slots with ``P > 0``, Q the softmax of
        ``scale * scores``; ``unit = (Q sum(P) - P) * scale`` (sum(P) = 1 up to rounding; kept
        exact), the gradient of ``kl[h, t]`` in the unscaled scores.
    """
    work = accumulation_dtype(scores)
    log_q = torch.log_softmax(scores.to(work) * scale, dim=-1)  # -inf at -1 slots
    target = target.to(work)
    terms = torch.where(
        target > 0, target * (torch.log(target.clamp_min(eps)) - log_q), torch.zeros_like(log_q)
    )
    unit = (torch.exp(log_q) * target.sum(-1, keepdim=True) - target) * scale
    return terms.sum(-1), unit


def _fused(target: torch.Tensor, index_q: torch.Tensor, fused: bool | None) -> bool:
    """Whether the Triton passes (:mod:`nemo_msa.indexer_loss.triton_byproducts`) run: where
    ``fused`` says so (None: on the kernels' device, CUDA or the host under the interpreter,
    where they take the inputs). They take an fp32 target and the index tensors of their record
    (:data:`~nemo_msa.backends.capabilities.TRITON_HELPERS`' ``loss_passes``: fp16/bf16, the
    Triton index head dims). They are deterministic (no atomics), so a
    deterministic-algorithms request keeps them.

    Raises:
        ValueError: ``fused`` on inputs the passes do not take, naming
            ``MSAKernels.loss_passes``.
    """
    reason = TRITON_HELPERS.loss_passes.why_not(dtype=index_q.dtype, dim=index_q.shape[-1])
    if reason is None and target.dtype != torch.float32:
        reason = f"the target (block mass) is {target.dtype}, not float32"
    if fused is None:
        unplanned.record("loss_passes")
        return kernels_run_on(target) and reason is None
    if fused and reason is None and not kernels_run_on(target):
        reason = f"the Triton kernels do not run on {target.device}"
    if fused and reason is not None:
        raise ValueError(f"MSAKernels.loss_passes=True but {reason}; the layer's plan did not "
                         "foresee these inputs")
    return fused


def block_scores_reference(
    index_q: torch.Tensor, index_k: torch.Tensor, q2k: torch.Tensor, msa,
    queries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each selected slot's block score and argmax key, in torch (the reference of
    :func:`nemo_msa.indexer_loss.triton_byproducts.block_scores_triton`).

    Args:
        index_q: [Tq, H, d] index queries (Tq = T without ``queries``).
        index_k: [T, d] the shared index key.
        q2k: int32 [H, Tq, K] document-local block ids, -1 at unused slots.
        msa: the layout (``MSAMicrobatch``).
        queries: int64 [Tq] global compact rows of index_q's tokens, or None.

    Returns:
        ``(scores [H, Tq, K], keys int32 [H, Tq, K])``: the max of q.k (in the accumulation
        dtype: fp32, fp64 for fp64 inputs) over the block's keys visible to the query (its own
        block up to itself; NaN when one of them is NaN), and the global compact row of the
        first key attaining it (the first NaN's); -inf and -1 at slots that are -1 or name a
        block past the query's own.
    """
    heads, tokens, top_k = q2k.shape
    block = msa.block_size
    work = accumulation_dtype(index_q)
    pos = query_rows(msa.document_positions, queries).long()
    rows = torch.arange(tokens, device=q2k.device) if queries is None else queries
    doc_start = rows - pos
    keys = torch.full((heads, tokens, top_k), -1, dtype=torch.int32, device=q2k.device)
    scores = torch.full((heads, tokens, top_k), -torch.inf, dtype=work, device=q2k.device)
    key_rows = index_k.to(work)
    offsets = torch.arange(block, device=q2k.device)
    chunk = max(1, _ARGMAX_GATHER_ELEMENTS // max(1, heads * top_k * block * index_q.shape[-1]))
    for start in range(0, tokens, chunk):
        stop = min(tokens, start + chunk)
        p = pos[start:stop].view(1, -1, 1, 1)
        ids = q2k[:, start:stop].long()  # [H, C, K]
        used = (ids >= 0) & (ids <= pos[start:stop].view(1, -1, 1) // block)
        j = ids.clamp(min=0)[..., None] * block + offsets  # [H, C, K, B] document-local
        visible = used[..., None] & (j <= p)
        rows_ = (doc_start[start:stop].view(1, -1, 1, 1) + j).clamp(0, index_k.shape[0] - 1)
        s = torch.einsum("chd,hckbd->hckb", index_q[start:stop].to(work), key_rows[rows_])
        s = s.masked_fill(~visible, -torch.inf)
        arg = s.argmax(-1)  # [H, C, K]; NaN counts as the largest
        found = doc_start[start:stop].view(1, -1, 1) + ids * block + arg
        keys[:, start:stop] = torch.where(used, found, -1).to(torch.int32)
        best = s.gather(-1, arg[..., None]).squeeze(-1)
        scores[:, start:stop] = torch.where(used, best, -torch.inf)
    return scores, keys


def _gather_scatter_grads(dscore, keys, index_q, index_k):
    """d index_q by a gather of the argmax keys, d index_k by a scatter onto them.

    Args:
        dscore: fp32 [H, T, K] gradient of each slot's (scaled) block score.
        keys: int32 [H, T, K] compact row of each slot's argmax key, -1 at unused slots.
        index_q: [T, H, d] ([Tq, H, d] for a query subset); index_k: [T, d].

    Returns:
        ``(d index_q [T, H, d], d index_k [T, d])`` in the inputs' dtypes. The scatter is
        ``index_add_``: deterministic on the CPU and, under
        ``torch.use_deterministic_algorithms(True)``, on CUDA (sort-based, no atomics).
    """
    heads, tokens, top_k = dscore.shape
    dim = index_q.shape[-1]
    work = accumulation_dtype(dscore)
    dq = torch.empty(tokens, heads, dim, dtype=work, device=index_q.device)
    dk = torch.zeros(index_k.shape[0], dim, dtype=work, device=index_q.device)
    key_rows = index_k.to(work)
    chunk = max(1, _BYPRODUCT_GATHER_ELEMENTS // max(1, heads * top_k * dim))
    for start in range(0, tokens, chunk):
        stop = min(tokens, start + chunk)
        used = keys[:, start:stop] >= 0  # [H, C, K]
        rows = keys[:, start:stop].long().clamp(min=0)
        g = torch.where(used, dscore[:, start:stop].to(work), 0.0)
        # Unused slots add nothing, not 0 times their stand-in row (NaN for a non-finite one).
        gathered = torch.where(used[..., None], key_rows[rows], 0.0)  # [H, C, K, d]
        dq[start:stop] = torch.einsum("hck,hckd->chd", g, gathered)
        q_rows = index_q[start:stop].to(work).permute(1, 0, 2)  # [H, C, d]
        contrib = torch.where(used[..., None], g[..., None] * q_rows[:, :, None, :], 0.0)
        dk.index_add_(0, rows.reshape(-1), contrib.reshape(-1, dim))
    return dq.to(index_q.dtype), dk.to(index_k.dtype)


def sparse_indexer_loss_from_byproducts(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    q2k: torch.Tensor,
    block_mass: torch.Tensor,
    msa,
    *,
    num_index_heads_total: int,
    loss_coeff: float,
    queries: torch.Tensor | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sparse indexer loss (score ``"max"``) from the sparse forward's block mass.

    The same function as ``compute_indexer_loss(..., sparse=True, score_type="max")``, with no
    pass over the main attention's keys: the target is the sparse forward's mass per selected
    slot, the prediction the softmax of the selected blocks' scores (max of index_q . index_k
    over the block's visible keys), found with each block's argmax key, which the gradient
    flows through, in one pass over the selected slots.

    Args:
        index_q: [T, H_local, d_idx] index queries (with gradient; [Tq, ...] with ``queries``).
        index_k: [T, d_idx] the shared index key (with gradient; every token).
        q2k: int32 [H_local, T, top_k] the selection (document-local block ids, -1 at unused
            slots; ``select_blocks``).
        block_mass: fp32 [H_local, T, top_k] the main attention's mean mass per slot over the
            group's query heads (``sparse_attention(..., return_block_mass=True)``).
        msa: the layout (``MSAMicrobatch``) the selection ran on.
        num_index_heads_total: index heads of the whole layer (all TP ranks).
        loss_coeff: msa_indexer_loss_coeff.
        queries: optional int64 [Tq] global compact rows of index_q's tokens (a query subset:
            context parallelism); q2k and the mass then have Tq token rows and the argmax keys
            are global rows of index_k. The KL is divided by index_k's (global) token count, so
            the ranks' losses add up to the unsplit loss.
        fused: run the Triton passes (a layer passes its plan's
            :attr:`~nemo_msa.plan.MSAKernels.loss_passes`); False: the torch references
            (:func:`block_scores_reference`, :func:`sparse_kl_forward_reference`); None chooses
            per call from the device and the inputs (a direct caller; counted by
            :mod:`nemo_msa.unplanned`).

    Returns:
        ``(loss, stats)`` as :func:`compute_indexer_loss`: ``coeff * sum_local KL / (T * H)``
        (T = index_k's rows) and ``{"kl": ...}``.

    Raises:
        ValueError: a selection or mass whose shape disagrees with ``index_q``, or an index_k
            whose rows disagree with the layout (named).
    """
    tokens, heads, index_dim = index_q.shape
    expected = (heads, tokens)
    for name, x in (("q2k", q2k), ("block_mass", block_mass)):
        if x.dim() != 3 or tuple(x.shape[:2]) != expected:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; expected [index_heads={heads}, "
                f"tokens={tokens}, top_k] like index_q {tuple(index_q.shape)}"
            )
    if block_mass.shape != q2k.shape:
        raise ValueError(
            f"q2k {tuple(q2k.shape)} and block_mass {tuple(block_mass.shape)} must have one "
            "shape"
        )
    if q2k.dtype != torch.int32:
        raise ValueError(f"q2k must be int32 block ids, got {q2k.dtype}")
    if queries is not None and queries.shape != (tokens,):
        raise ValueError(
            f"queries has shape {tuple(queries.shape)}; expected [{tokens}] like index_q"
        )
    if queries is None and index_k.shape[0] != tokens:
        raise ValueError(
            f"index_k has {index_k.shape[0]} rows but index_q {tokens}; pass queries= for a "
            "query subset"
        )
    if index_k.shape[0] != msa.num_tokens:
        raise ValueError(
            f"index_k has {index_k.shape[0]} rows but the layout msa has "
            f"num_tokens={msa.num_tokens}"
        )
    denominator = float(index_k.shape[0] * num_index_heads_total)
    kl = _SparseKLFromByproducts.apply(
        index_q, index_k, q2k, block_mass.detach(), msa, queries,
        1.0 / math.sqrt(index_dim), denominator, fused,
    )
    return kl * loss_coeff, {"kl": kl.detach()}
