"""The one-kernel RoPE (nemo_msa.triton.rope) is Megatron's unfused RoPE bit for bit, forward
and gradient, in bf16 (fp16 takes the torch ops, also checked here): partial and full rotary
dims, rotary halves that are not powers of two, strided inputs (q out of a fused qkv
projection), through nemo_msa.megatron.rope's autograd function. Interpreter on the CPU,
compiled on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _msa_support import KERNEL_DEVICE
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

from nemo_msa.megatron.rope import _kernel_runs, apply_rope, rope_factors
from nemo_msa.testing.op_count import OpCounter

_CP = object()  # Megatron looks the CP group up when given None; the bshd path never reads it
_CONFIG = SimpleNamespace(rotary_interleaved=False, apply_rope_fusion=False,
                          multi_latent_attention=False, mrope_section=None)


def _case(dtype, tokens, heads, dim, rot, seed, strided):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 9000, (tokens,), generator=gen).double()
    inv = 1.0 / (5e6 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    angles = torch.outer(positions, inv)
    freqs = torch.cat((angles, angles), -1).float().view(tokens, 1, rot)
    wide = (torch.randn(tokens, heads, dim + 8, generator=gen) * 3).to(KERNEL_DEVICE, dtype)
    # strided: q as a view of a wider projection output
    t = wide[..., 4:4 + dim] if strided else wide[..., :dim].contiguous()
    grad = torch.randn(tokens, heads, dim, generator=gen).to(KERNEL_DEVICE, dtype)
    return t, freqs.to(KERNEL_DEVICE), grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "heads", "dim", "rot", "strided"), [
    (37, 4, 32, 16, False), (20, 1, 32, 32, False), (9, 3, 40, 24, True), (33, 2, 128, 64, True),
])
def test_kernel_rope_is_megatrons_bit_for_bit(dtype, tokens, heads, dim, rot, strided):
    t, freqs, grad = _case(dtype, tokens, heads, dim, rot, tokens + dim, strided)
    assert t.is_contiguous() is not strided
    a = t.detach().clone().requires_grad_()
    b = t.detach().requires_grad_()  # strided stays strided
    factors = rope_factors(freqs, _CONFIG)
    # fp16 keeps the torch ops (the compiled kernel's fp16 rounding was one ulp off on the H200)
    kernel = dtype == torch.bfloat16
    assert _kernel_runs(b, factors.tables(dtype)[0], factors.fused) is kernel
    want = apply_rotary_pos_emb(a, freqs, config=_CONFIG, cp_group=_CP)
    with OpCounter() as ops:
        got = apply_rope(b, factors, _CONFIG)
        got.backward(grad)
    want.backward(grad)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert torch.equal(b.grad, a.grad), (b.grad.float() - a.grad.float()).abs().max()
    kernels = [op for (_, op) in ops.ops if op.startswith("triton:")]
    if kernel:
        assert kernels == ["triton:_rope_kernel"] and ops.total == 2, ops.table()
    else:
        assert kernels == [], ops.table()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernel)")
def test_kernel_rope_at_minimax_m3_shape_gpu():
    """Compiled, at MiniMax-M3's attention q ([8192, 64, 128] bf16, 64 rotated channels, as a
    strided view) and index_k ([8192, 1, 128]); no host synchronization."""
    for heads, strided in ((64, True), (1, False)):
        t, freqs, grad = _case(torch.bfloat16, 8192, heads, 128, 64, heads, strided)
        a = t.detach().clone().requires_grad_()
        b = t.detach().requires_grad_()
        want = apply_rotary_pos_emb(a, freqs, config=_CONFIG, cp_group=_CP)
        want.backward(grad)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # the kernels never wait on the host
        try:
            got = apply_rope(b, rope_factors(freqs, _CONFIG), _CONFIG)
            got.backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want) and torch.equal(b.grad, a.grad)
