"""The by-product indexer loss's backward in one Triton kernel: d index_q and d index_k.

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

__all__ = ["byproduct_grads_triton"]

# Tokens per program: the [BT, d] accumulator and index_q rows stay in registers.
_BT = 32


@triton.jit
def _byproduct_grads_kernel(
    dscore_ptr, keys_ptr, iq_ptr, ik_ptr, dq_ptr, dk_ptr,
    T, stride_sh, stride_st, stride_iqt, stride_iqh, stride_ikt, stride_dqt,
    K: tl.constexpr, BT: tl.constexpr, DI: tl.constexpr,
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
    for k in tl.static_range(K):
        key = tl.load(keys_ptr + base + k, mask=ok, other=-1)
        used = ok & (key >= 0)
        g = tl.load(dscore_ptr + base + k, mask=used, other=0.0)
        g = tl.where(used, g, 0.0)
        row = tl.where(used, key, 0).to(tl.int64)
        ik = tl.load(ik_ptr + row[:, None] * stride_ikt + de[None, :], mask=used[:, None],
                     other=0.0).to(tl.float32)
        acc += g[:, None] * ik
        tl.atomic_add(dk_ptr + row[:, None] * DI + de[None, :], g[:, None] * iq,
                      mask=used[:, None])
    tl.store(dq_ptr + t64[:, None] * stride_dqt + h * DI + de[None, :], acc, mask=ok[:, None])


def byproduct_grads_triton(
    dscore: torch.Tensor, keys: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """d index_q by a gather of the argmax keys, d index_k by atomic adds onto them.

    Args:
        dscore: fp32 [H, T, K] gradient of each slot's (scaled) block score.
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
    dq = torch.empty(tokens, heads, dim, dtype=torch.float32, device=iq.device)
    dk = torch.zeros(ik.shape[0], dim, dtype=torch.float32, device=iq.device)
    if tokens:
        _byproduct_grads_kernel[(triton.cdiv(tokens, _BT), heads)](
            dscore, keys, iq, ik, dq, dk, tokens, dscore.stride(0), dscore.stride(1),
            iq.stride(0), iq.stride(1), ik.stride(0), dq.stride(0), K=top_k, BT=_BT, DI=dim,
            num_warps=4,
        )
    return dq.to(index_q.dtype), dk.to(index_k.dtype)
