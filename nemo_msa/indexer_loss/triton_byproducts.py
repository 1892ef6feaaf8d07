"""The by-product indexer loss in two Triton kernels: the KL with its score gradient, and
d index_q / d index_k.

The forward (:func:`sparse_kl_forward_triton`; its torch reference
:func:`nemo_msa.indexer_loss.byproducts.sparse_kl_forward_reference`) reads the selected
slots' scores and the target once and writes each row's KL and the unit score gradient
``(softmax(scale s) * sum(P) - P) * scale``, which the backward only scales: on the GPU about a
dozen small kernels (log-softmax, log, masks, products, sums) each way became one (issue #28).

``d index_q[t, h] = sum_k g[h, t, k] index_k[key[h, t, k]]`` (a gather of the argmax keys) and
``d index_k[j] = sum over slots whose argmax key is j of g[h, t, k] index_q[t, h]`` (a scatter
onto them), for g the fp32 gradient of each slot's scaled block score. The torch version
(:func:`nemo_msa.indexer_loss.byproducts._gather_scatter_grads`, the reference) materializes
the gathered rows and the scattered products as fp32 [H, T, top_k, d] tensors in chunks: on
the H200 about 7 ms per layer at 32768 tokens (issue #28's profile). Here one program per
(32 tokens, index head) reads its slots' keys once and writes d index_q once; d index_k is an
fp32 atomic add per slot (as ``index_add_`` on CUDA: the summation order is not fixed; under
``torch.use_deterministic_algorithms(True)`` the torch version runs instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["byproduct_grads_triton", "sparse_kl_forward_triton"]

# Tokens per program: the [BT, d] accumulator and index_q rows stay in registers.
_BT = 32
# Tokens per program of the KL forward: [BT, top_k] fp32 tiles.
_BT_KL = 64


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
def _byproduct_grads_kernel(
    dscore_ptr, keys_ptr, iq_ptr, ik_ptr, dq_ptr, dk_ptr, factor_ptr,
    T, stride_sh, stride_st, stride_iqt, stride_iqh, stride_ikt, stride_dqt,
    K: tl.constexpr, BT: tl.constexpr, DI: tl.constexpr, FACTOR: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t = pid * BT + tl.arange(0, BT)
    ok = t < T
    t64 = t.to(tl.int64)
    de = tl.arange(0, DI)
    iq = tl.load(iq_ptr + t64[:, None] * stride_iqt + h * stride_iqh + de[None, :],
                 mask=ok[:, None], other=0.0).to(tl.float32)
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
        tl.atomic_add(dk_ptr + row[:, None] * DI + de[None, :], g[:, None] * iq,
                      mask=used[:, None])
    tl.store(dq_ptr + t64[:, None] * stride_dqt + h * DI + de[None, :], acc, mask=ok[:, None])


def byproduct_grads_triton(
    dscore: torch.Tensor, keys: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    factor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """d index_q by a gather of the argmax keys, d index_k by atomic adds onto them.

    Args:
        dscore: fp32 [H, T, K] gradient of each slot's block score (times ``factor``).
        factor: optional fp32 one-element tensor multiplying ``dscore`` inside the kernel (the
            incoming gradient over the loss's denominator: read on the device, no host sync,
            no extra kernel).
        keys: int32 [H, T, K] compact row of each slot's argmax key, -1 at unused slots.
        index_q: [T, H, d] bf16/fp16 ([Tq, H, d] for a query subset); index_k: [T, d], same
            dtype (d a power of two, 16..128).

    Returns:
        ``(d index_q [T, H, d], d index_k [T, d])`` in the inputs' dtypes (fp32 inside).
    """
    heads, tokens, top_k = dscore.shape
    dim = index_q.shape[-1]
    dscore = dscore.contiguous()
    keys = keys.contiguous()
    iq = index_q.contiguous()
    ik = index_k.contiguous()
    # d index_q is written once per element: stored in index_q's dtype directly (the same
    # rounding as a cast after); d index_k is summed atomically, so it adds in fp32.
    dq = torch.empty(tokens, heads, dim, dtype=index_q.dtype, device=iq.device)
    dk = torch.zeros(ik.shape[0], dim, dtype=torch.float32, device=iq.device)
    if tokens:
        _byproduct_grads_kernel[(triton.cdiv(tokens, _BT), heads)](
            dscore, keys, iq, ik, dq, dk, dscore if factor is None else factor, tokens,
            dscore.stride(0), dscore.stride(1), iq.stride(0), iq.stride(1), ik.stride(0),
            dq.stride(0), K=top_k, BT=_BT, DI=dim, FACTOR=factor is not None, num_warps=4,
        )
    return dq, dk.to(index_k.dtype)
