"""The sparse indexer loss (score ``"max"``) from the kernels' by-products, with no key pass.

The target is the sparse forward's mass per selected block (accumulated in its pass over K/V),
the prediction the softmax of the selected blocks' real scores with their argmax keys (emitted by
the selection kernel), so the KL and its gradients cost O(T x H x top_k x d): d index_q is a
gather of the argmax keys, d index_k a deterministic ``index_add_`` onto them.
:func:`nemo_msa.indexer_loss.naive.compute_indexer_loss` with ``sparse=True`` is its reference.
"""

from __future__ import annotations

import math

import torch

from nemo_msa.indexer_loss.triton_byproducts import (
    byproduct_grads_triton,
    sparse_kl_forward_triton,
)
from nemo_msa.limits import accumulation_dtype
from nemo_msa.triton.kernel_layout import INTERPRET

__all__ = ["sparse_indexer_loss_from_byproducts", "sparse_kl_forward_reference"]

_EPS = 1e-10

# Elements of one chunk's gathered [H, C, top_k, d] rows in the by-product loss's backward.
_BYPRODUCT_GATHER_ELEMENTS = 1 << 25


class _SparseKLFromByproducts(torch.autograd.Function):
    """sum_{h,t} KL(P_h(t) || softmax(scale * s_h(t))) over the selected slots, divided by
    ``denominator``; differentiable in index_q and index_k through the argmax keys.

    Where the kernels run (:func:`_fused`), the forward is one Triton kernel that also writes
    the unit score gradient, and the backward only scales it inside the gather/scatter kernel:
    nothing of the forward is recomputed and no elementwise kernel runs around them. Elsewhere
    the same function in torch (:func:`sparse_kl_forward_reference`).
    """

    @staticmethod
    def forward(ctx, index_q, index_k, scores, keys, target, index_scale, denominator):
        fused = _fused(scores, index_q)
        forward = sparse_kl_forward_triton if fused else sparse_kl_forward_reference
        row_kl, unit = forward(scores, target, index_scale, _EPS)
        ctx.save_for_backward(index_q, index_k, keys, unit)
        ctx.denominator = denominator
        return row_kl.sum() / denominator

    @staticmethod
    def backward(ctx, grad):
        index_q, index_k, keys, unit = ctx.saved_tensors
        # d KL / d s_b = (Q_b * sum(P) - P_b) * scale, times d loss / d KL.
        factor = grad.to(unit.dtype) / ctx.denominator
        if _fused(unit, index_q):
            dq, dk = byproduct_grads_triton(unit, keys, index_q, index_k, factor=factor)
        else:
            dq, dk = _gather_scatter_grads(unit * factor, keys, index_q, index_k)
        return dq, dk, None, None, None, None, None


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


def _fused(dscore: torch.Tensor, index_q: torch.Tensor) -> bool:
    """The Triton kernels (:func:`sparse_kl_forward_triton`, :func:`byproduct_grads_triton`)
    where they run: the kernels' device (CUDA, or the host under the interpreter), fp32 scores,
    fp16/bf16 index tensors, d a power of two in 16..128, and no deterministic-algorithms
    request (the backward's d index_k adds atomically, as ``index_add_`` does on CUDA; the torch
    version is deterministic under that request)."""
    dim = index_q.shape[-1]
    return (
        (dscore.is_cuda or INTERPRET)
        and dscore.dtype == torch.float32
        and index_q.dtype in (torch.float16, torch.bfloat16)
        and dim in (16, 32, 64, 128)
        and not torch.are_deterministic_algorithms_enabled()
    )


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
    queries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sparse indexer loss (score ``"max"``) from the selection's and the forward's by-products.

    The same function as ``compute_indexer_loss(..., sparse=True, score_type="max")``, with no
    pass over the keys: the target is the sparse forward's mass per selected slot and the
    prediction the softmax of the selected blocks' real scores.

    Args:
        index_q: [T, H_local, d_idx] index queries (with gradient; [Tq, ...] with ``queries``).
        index_k: [T, d_idx] the shared index key (with gradient; every token).
        block_scores: fp32 [H_local, T, top_k] unscaled block max of index_q . index_k per slot,
            -inf at -1 slots (``select_blocks(..., return_scores=True)``).
        block_keys: int32 [H_local, T, top_k] compact row of the key attaining each slot's max,
            -1 at -1 slots.
        block_mass: fp32 [H_local, T, top_k] the main attention's mean mass per slot over the
            group's query heads (``sparse_attention(..., return_block_mass=True)``).
        num_index_heads_total: index heads of the whole layer (all TP ranks).
        loss_coeff: msa_indexer_loss_coeff.
        queries: optional int64 [Tq] global compact rows of index_q's tokens (a query subset:
            context parallelism); the by-products then have Tq token rows and their keys are
            global rows of index_k. The KL is divided by index_k's (global) token count, so the
            ranks' losses add up to the unsplit loss.

    Returns:
        ``(loss, stats)`` as :func:`compute_indexer_loss`: ``coeff * sum_local KL / (T * H)``
        (T = index_k's rows) and ``{"kl": ...}``.

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
    if queries is not None and queries.shape != (tokens,):
        raise ValueError(
            f"queries has shape {tuple(queries.shape)}; expected [{tokens}] like index_q"
        )
    if queries is None and index_k.shape[0] != tokens:
        raise ValueError(
            f"index_k has {index_k.shape[0]} rows but index_q {tokens}; pass queries= for a "
            "query subset"
        )
    denominator = float(index_k.shape[0] * num_index_heads_total)
    kl = _SparseKLFromByproducts.apply(
        index_q, index_k, block_scores, block_keys, block_mass.detach(),
        1.0 / math.sqrt(index_dim), denominator,
    )
    return kl * loss_coeff, {"kl": kl.detach()}


