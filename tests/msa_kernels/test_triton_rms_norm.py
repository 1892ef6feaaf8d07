"""The one-kernel RMSNorm (nemo_msa.triton.rms_norm, the MSA indexer's q/k norms in fp16/bf16)
against the float64 formula ``x * rsqrt(mean(x^2) + eps) * w'`` (w' = 1 + w zero-centred, else
w) and against the torch path it replaces (outputs, d x, d w) through
``nemo_msa.megatron.norms.RMSNorm.forward``; fewer kernels. Interpreter on the CPU, compiled on
a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _msa_support import KERNEL_DEVICE

from nemo_msa.megatron import norms
from nemo_msa.testing.op_count import OpCounter
from nemo_msa.testing.oracle import rel_err


def _norm(weight, centered, dim, fused):
    return SimpleNamespace(weight=weight, _sum_grad=False, hidden_size=dim, eps=1e-6,
                           zero_centered_gamma=centered, fused=fused)


def _run(x, weight, dout, centered, kernel):
    xs, ws = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    with OpCounter() as ops:
        out = norms.RMSNorm.forward(_norm(ws, centered, x.shape[-1], kernel), xs)
        out.backward(dout)
    return [out.detach(), xs.grad, ws.grad], ops


def _host(tensors):
    return [t.cpu().double() for t in tensors]


def _f64(x, weight, dout, centered):
    xs, ws = x.double().cpu().requires_grad_(), weight.double().cpu().requires_grad_()
    scale = 1.0 + ws if centered else ws
    out = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    out.backward(dout.double().cpu())
    return [out.detach(), xs.grad, ws.grad]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "centered"), [((37, 4, 64), True), ((70, 128), False),
                                                 ((5, 3, 32), True)])
def test_kernel_norm_equals_float64_and_the_torch_path(dtype, shape, centered):
    gen = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=gen) * 3).to(KERNEL_DEVICE, dtype)
    weight = (torch.randn(shape[-1], generator=gen) * 0.2 + (0 if centered else 1)).to(
        KERNEL_DEVICE, torch.bfloat16)
    dout = torch.randn(*shape, generator=gen).to(KERNEL_DEVICE, dtype)
    kernel, kernel_ops = _run(x, weight, dout, centered, True)
    torch_path, torch_ops = _run(x, weight, dout, centered, False)
    kernel, torch_path = _host(kernel), _host(torch_path)
    want = _f64(x, weight, dout, centered)
    # One rounding of fp32 values to bf16 / fp16 (relative 2^-9 / 2^-12 at most); d w is in the
    # weight's dtype (bf16).
    unit = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12
    for got, ref, exp, tol in zip(kernel, torch_path, want, (unit, unit, 2.0**-8), strict=True):
        assert torch.isfinite(got).all()
        assert rel_err(got, exp) < tol and rel_err(got, ref) < tol
    # The outputs are the torch path's roundings of (nearly) the same fp32 values.
    assert (kernel[0] != torch_path[0]).float().mean() < 1e-3
    triton_launches = [op for (_, op) in kernel_ops.ops if op.startswith("triton:")]
    assert sorted(triton_launches) == ["triton:_rms_bwd_kernel", "triton:_rms_fwd_kernel"]
    assert kernel_ops.total < torch_ops.total, (kernel_ops.table(), torch_ops.table())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernel)")
def test_kernel_norm_at_minimax_m3_index_shape_gpu():
    """Compiled, at MiniMax-M3's index_q ([8192, 4, 128] bf16, zero-centred weight); no host
    synchronization."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(8192, 4, 128, generator=gen) * 3).to("cuda", torch.bfloat16)
    weight = (torch.randn(128, generator=gen) * 0.2).to("cuda", torch.bfloat16)
    dout = torch.randn(8192, 4, 128, generator=gen).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the kernels never wait on the host
    try:
        kernel, _ = _run(x, weight, dout, True, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch_path, _ = _run(x, weight, dout, True, False)
    kernel, torch_path = _host(kernel), _host(torch_path)
    want = _f64(x, weight, dout, True)
    for got, ref, exp in zip(kernel, torch_path, want, strict=True):
        assert rel_err(got, exp) < 1e-2 and rel_err(got, ref) < 1e-2
    assert (kernel[0] != torch_path[0]).float().mean() < 1e-3
