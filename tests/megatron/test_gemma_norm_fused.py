"""GemmaRMSNorm on torch's fused RMSNorm (issue #28: fewer kernels around the indexer) computes
what the explicit formula ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32 computes: outputs and
the gradients of x and w, for fp32 and bf16 inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_msa.megatron.norms import GemmaRMSNorm


def _explicit(x, weight, eps):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gemma_norm_equals_the_explicit_formula(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 4, 64, generator=gen) * 3).to(dtype)
    weight = torch.randn(64, generator=gen) * 0.2
    dout = torch.randn(37, 4, 64, generator=gen).to(dtype)
    grads = []
    for fn in ("fused", "explicit"):
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        if fn == "fused":
            # fused=False: torch's F.rms_norm (the Triton kernel has its own test module).
            norm = SimpleNamespace(weight=ws, _sum_grad=False, hidden_size=64, eps=1e-6,
                                   zero_centered_gamma=True, fused=False)
            out = GemmaRMSNorm.forward(norm, xs)
        else:
            out = _explicit(xs, ws, 1e-6)
        out.backward(dout)
        grads.append((out.detach().float(), xs.grad.float(), ws.grad.float()))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in zip(*grads, strict=True):
        assert torch.isfinite(a).all()
        assert float((a - b).norm() / b.norm()) < tol
    if dtype == torch.bfloat16:  # one rounding of the same fp32 values
        assert torch.equal(grads[0][0], grads[1][0])
