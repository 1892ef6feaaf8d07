"""RoPE at per-token angles in one Triton kernel each way, bit for bit the torch arithmetic.

The torch version (:class:`nemo_msa.megatron.rope` ``_Rope``, itself Megatron's unfused RoPE bit
for bit) runs 5 elementwise kernels each way over the tensor; on the attention's q ([T, 64, 128]
bf16 for MiniMax-M3, 128 MiB at 8192 tokens) each is a full pass. Here one pass: per row
(token, head) the halves ``x1, x2`` of the rotated channels and the pass-through channels.

Forward ``y1 = x1 c1 + x2 s1``, ``y2 = x2 c2 + x1 s2``; backward ``d1 = g1 c1 + g2 s2``,
``d2 = g2 c2 + g1 s1`` (``s`` the sign-folded sine, ``cat(-sin1, sin2)``). For fp16/bf16 inputs
every product of two fp16/bf16 numbers is exact in fp32, so rounding each product and the sum
to the input dtype (round to nearest even) gives torch's elementwise results exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rope_triton", "round_to_input"]

# Rows (token, head) per program.
_BR = 16


@triton.jit
def round_to_input(x, IS_BF16: tl.constexpr):
    """fp32 -> the input dtype, round to nearest even (torch's elementwise rounding). bf16 by
    integer arithmetic on the bits, so the interpreter (whose cast truncates) rounds as the GPU
    does; NaN stays NaN (a quiet NaN's payload bits survive the add)."""
    if IS_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.float16)


@triton.jit
def _rope_kernel(
    t_ptr, cos_ptr, sin_ptr, out_ptr, R, H, stride_tt, stride_th, stride_ct,
    HALF: tl.constexpr, HALF_P: tl.constexpr, PASS: tl.constexpr, PASS_P: tl.constexpr,
    BR: tl.constexpr, BACKWARD: tl.constexpr, IS_BF16: tl.constexpr,
):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = r < R
    tok = (r // H).to(tl.int64)
    head = (r % H).to(tl.int64)
    src = t_ptr + tok * stride_tt + head * stride_th
    dst = out_ptr + r.to(tl.int64) * (2 * HALF + PASS)
    c = tl.arange(0, HALF_P)
    m = ok[:, None] & (c < HALF)[None, :]
    x1 = tl.load(src[:, None] + c[None, :], mask=m, other=0.0)
    x2 = tl.load(src[:, None] + HALF + c[None, :], mask=m, other=0.0)
    trig = tok[:, None] * stride_ct + c[None, :]
    c1 = tl.load(cos_ptr + trig, mask=m, other=0.0)
    c2 = tl.load(cos_ptr + trig + HALF, mask=m, other=0.0)
    s1 = tl.load(sin_ptr + trig, mask=m, other=0.0)
    s2 = tl.load(sin_ptr + trig + HALF, mask=m, other=0.0)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    a1 = round_to_input(x1 * c1.to(tl.float32), IS_BF16).to(tl.float32)
    a2 = round_to_input(x2 * c2.to(tl.float32), IS_BF16).to(tl.float32)
    if BACKWARD:
        b1 = round_to_input(x2 * s2.to(tl.float32), IS_BF16).to(tl.float32)
        b2 = round_to_input(x1 * s1.to(tl.float32), IS_BF16).to(tl.float32)
    else:
        b1 = round_to_input(x2 * s1.to(tl.float32), IS_BF16).to(tl.float32)
        b2 = round_to_input(x1 * s2.to(tl.float32), IS_BF16).to(tl.float32)
    tl.store(dst[:, None] + c[None, :], round_to_input(a1 + b1, IS_BF16), mask=m)
    tl.store(dst[:, None] + HALF + c[None, :], round_to_input(a2 + b2, IS_BF16), mask=m)
    if PASS > 0:
        p = tl.arange(0, PASS_P)
        mp = ok[:, None] & (p < PASS)[None, :]
        rest = tl.load(src[:, None] + 2 * HALF + p[None, :], mask=mp, other=0.0)
        tl.store(dst[:, None] + 2 * HALF + p[None, :], rest, mask=mp)


def rope_triton(
    t: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, backward: bool = False
) -> torch.Tensor:
    """RoPE (or its transpose, for the gradient) of ``t`` in one kernel.

    Args:
        t: fp16/bf16 [T, H, dim] (any strides of the first two dims; the last contiguous is
            not required: copied then), or the output's gradient for ``backward``.
        cos: [T, 1, rot] in t's dtype, contiguous: ``cos(angles)``.
        sin_signed: [T, 1, rot] in t's dtype, contiguous: ``cat(-sin1, sin2)`` of the angles.
        backward: apply the transpose (the gradient of the forward).

    Returns:
        A new contiguous [T, H, dim] tensor in t's dtype.
    """
    tokens, heads, dim = t.shape
    rot = cos.shape[-1]
    if t.stride(-1) != 1:
        t = t.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=t.dtype, device=t.device)
    rows = tokens * heads
    if rows:
        half, rest = rot // 2, dim - rot
        _rope_kernel[(triton.cdiv(rows, _BR),)](
            t, cos, sin_signed, out, rows, heads, t.stride(0), t.stride(1), cos.stride(0),
            HALF=half, HALF_P=triton.next_power_of_2(half), PASS=rest,
            PASS_P=triton.next_power_of_2(max(rest, 1)), BR=_BR, BACKWARD=backward,
            IS_BF16=t.dtype == torch.bfloat16, num_warps=4,
        )
    return out
