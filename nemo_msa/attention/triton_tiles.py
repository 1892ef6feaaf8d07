"""@triton.jit building blocks shared by the MSA kernels (inlined by Triton at compile time).

Every attention kernel reads one [N, d] tile of K and V of one KV head from a list of compact
token rows, and the query-outer forwards fold it into an exp2-domain online softmax. Keeping
those steps here gives every kernel the same masking and the same interpreter rule (dot operands
cast to fp32 under ``TRITON_INTERPRET=1``, see PLATFORM.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # host float (softmax scale -> log2 domain)
# The same constants for use inside kernels: Triton reads only constexpr globals.
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(0.6931471805599453)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1); Triton tile sizes must be powers of two."""
    return 1 << max(0, (x - 1).bit_length())


@triton.jit
def load_kv_tile(k_ptr, v_ptr, rows, mask, g, stride_kt, stride_kh, stride_vt, stride_vh,
                 D: tl.constexpr, FP32_DOT: tl.constexpr):
    """K and V of KV head ``g`` at compact rows ``rows`` (int64 [N]): two [N, D] tiles, zero
    where ``mask`` is False; fp32 when ``FP32_DOT`` (the interpreter), else the input dtype."""
    dd = tl.arange(0, D)
    k = tl.load(k_ptr + rows[:, None] * stride_kt + g * stride_kh + dd[None, :],
                mask=mask[:, None], other=0.0)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + g * stride_vh + dd[None, :],
                mask=mask[:, None], other=0.0)
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def online_softmax_step(sc, v, m_i, l_i, acc):
    """Folds one key tile into the running softmax of each row.

    Args:
        sc: fp32 [M, N] scores in the log2 domain, -inf where a key is not visible.
        v: [N, D] values (the dot's operand dtype).
        m_i, l_i: fp32 [M] running max and sum; acc: fp32 [M, D] running output.

    Returns:
        The updated ``(m_i, l_i, acc)``. A row that has seen no visible key keeps m = -inf and
        is shifted by 0 instead, so it never produces NaN.
    """
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    pr = tl.exp2(sc - m_use[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def finish_softmax(m_i, l_i, acc):
    """The normalized output [M, D] and the natural-log LSE [M] (-inf and 0 for empty rows)."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))
    return out, tl.where(empty, float("-inf"), lse2 * LN2_C)


@triton.jit
def dq_tile(q, do, k, v, pr_mask, lse2, delta, scale_log2):
    """dS K of one key tile for the dq kernels (before the softmax scale).

    Args:
        q, do: [M, D] queries and output gradients; k, v: [N, D]; pr_mask: bool [M, N] visible
            (row, key) pairs; lse2: fp32 [M] LSE in the log2 domain; delta: fp32 [M]
            rowsum(dO * O).

    Returns:
        fp32 [M, D]: this tile's contribution to dq / scale.
    """
    sc = tl.dot(q, tl.trans(k)) * scale_log2
    pr = tl.where(pr_mask, tl.exp2(sc - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = pr * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k)
