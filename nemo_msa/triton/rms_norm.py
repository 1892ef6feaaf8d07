"""RMSNorm of fp16/bf16 rows in one Triton kernel each way, fp32 inside.

``y = x * rsqrt(mean(x^2) + eps) * w'`` with ``w' = 1 + w`` (zero-centred, Gemma) or ``w``,
computed in fp32 and rounded once to x's dtype: the function of
:class:`nemo_msa.megatron.norms.RMSNorm`'s torch path (the reference: ``x.to(fp32)``, torch's
fused ``rms_norm`` with the fp32 weight, ``.to(x.dtype)``), which runs five kernels forward
(two casts of x, one of the weight, ``1 + w``, the norm) and about six backward. Here one
forward kernel; one backward kernel for d x plus a sum of per-program d w partials
(deterministic: no atomics). For the MSA indexer's q/k norms (issue #28).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nemo_msa.triton.rope import round_to_input

__all__ = ["rms_norm_backward_triton", "rms_norm_forward_triton"]

# Rows per program.
_BR = 32


@triton.jit
def _rms_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, R, eps,
                    D: tl.constexpr, BR: tl.constexpr, CENTERED: tl.constexpr,
                    IS_BF16: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = r < R
    c = tl.arange(0, D)
    offs = r.to(tl.int64)[:, None] * D + c[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c).to(tl.float32)
    if CENTERED:
        w = w + 1.0
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    y = round_to_input(x * rstd[:, None] * w[None, :], IS_BF16)
    tl.store(y_ptr + offs, y, mask=ok[:, None])
    tl.store(rstd_ptr + r, rstd, mask=ok)


@triton.jit
def _rms_bwd_kernel(x_ptr, w_ptr, g_ptr, rstd_ptr, dx_ptr, dw_ptr, R,
                    D: tl.constexpr, BR: tl.constexpr, CENTERED: tl.constexpr,
                    IS_BF16: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BR + tl.arange(0, BR)
    ok = r < R
    c = tl.arange(0, D)
    offs = r.to(tl.int64)[:, None] * D + c[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + r, mask=ok, other=0.0)
    w = tl.load(w_ptr + c).to(tl.float32)
    if CENTERED:
        w = w + 1.0
    xhat = x * rstd[:, None]
    gw = g * w[None, :]
    dx = rstd[:, None] * (gw - xhat * (tl.sum(gw * xhat, 1) / D)[:, None])
    tl.store(dx_ptr + offs, round_to_input(dx, IS_BF16), mask=ok[:, None])
    tl.store(dw_ptr + pid * D + c, tl.sum(g * xhat, 0))


def rms_norm_forward_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward.

    Args:
        x: fp16/bf16 [..., D], D a power of two (the last dim normalized).
        weight: [D] any float dtype (``1 + weight`` when ``centered``).
        eps: added to the mean square.
        centered: zero-centred weight.

    Returns:
        ``(y, rstd)``: y like x (contiguous), rstd fp32 [rows] (for the backward).
    """
    dim = x.shape[-1]
    x = x.contiguous()
    rows = x.numel() // dim
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _rms_fwd_kernel[(triton.cdiv(rows, _BR),)](
            x, weight.contiguous(), y, rstd, rows, float(eps), D=dim, BR=_BR, CENTERED=centered,
            IS_BF16=x.dtype == torch.bfloat16, num_warps=4,
        )
    return y, rstd


def rms_norm_backward_triton(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    centered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward: ``(d x like x, d weight fp32 [D])``."""
    dim = x.shape[-1]
    x = x.contiguous()
    grad = grad.contiguous()
    rows = x.numel() // dim
    dx = torch.empty_like(x)
    programs = triton.cdiv(rows, _BR)
    partial = torch.empty(programs, dim, dtype=torch.float32, device=x.device)
    if rows:
        _rms_bwd_kernel[(programs,)](
            x, weight.contiguous(), grad, rstd, dx, partial, rows, D=dim, BR=_BR,
            CENTERED=centered, IS_BF16=x.dtype == torch.bfloat16, num_warps=4,
        )
    return dx, partial.sum(0)
