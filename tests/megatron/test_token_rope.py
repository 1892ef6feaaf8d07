"""nemo_msa.megatron.rope computes Megatron's unfused RoPE bit for bit (forward and gradient), in
bf16, fp32 and float64, partial and full rotary dims, heads broadcast; interleaved RoPE is
Megatron's own function; and it launches fewer kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

from nemo_msa.megatron.rope import apply_rope, rope_factors
from nemo_msa.testing.op_count import OpCounter

# Megatron looks the CP group up when given None; the bshd path never reads it.
_CP = object()


def _config(interleaved=False):
    return SimpleNamespace(rotary_interleaved=interleaved, apply_rope_fusion=False,
                           multi_latent_attention=False, mrope_section=None)


def _inputs(dtype, tokens, heads, dim, rot, seed):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 5000, (tokens,), generator=gen).double()
    inv = 1.0 / (5e6 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    angles = torch.outer(positions, inv)
    freqs = torch.cat((angles, angles), -1).float().view(tokens, 1, rot)
    t = (torch.randn(tokens, heads, dim, generator=gen) * 3).to(dtype)
    grad = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    return t, freqs, grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(("heads", "dim", "rot"), [(4, 32, 16), (1, 32, 32), (3, 128, 64)])
def test_apply_rope_is_megatrons_function_bit_for_bit(dtype, heads, dim, rot):
    t, freqs, grad = _inputs(dtype, 37, heads, dim, rot, seed=dim + rot)
    config = _config()
    a = t.clone().requires_grad_()
    b = t.clone().requires_grad_()
    want = apply_rotary_pos_emb(a, freqs, config=config, cp_group=_CP)
    got = apply_rope(b, rope_factors(freqs, config), config)
    want.backward(grad)
    got.backward(grad)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(b.grad, a.grad)


def test_interleaved_rope_is_megatrons_and_shared_factors_are_built_once():
    """At the layers' shapes (t [tokens, heads, dim], angles [tokens, 1, rot]): Megatron's
    interleaved function on its [s, b, h, d] layout, forward and gradient."""
    t, freqs, grad = _inputs(torch.bfloat16, 9, 2, 32, 16, seed=1)
    config = _config(interleaved=True)
    a = t.view(9, 1, 2, 32).clone().requires_grad_()
    b = t.clone().requires_grad_()
    want = apply_rotary_pos_emb(a, freqs.view(9, 1, 1, 16), config=config, cp_group=_CP)
    got = apply_rope(b, rope_factors(freqs, config), config, _CP)
    want.backward(grad.view(9, 1, 2, 32))
    got.backward(grad)
    assert got.shape == t.shape and torch.equal(got, want.view(9, 2, 32))
    assert torch.equal(b.grad, a.grad.view(9, 2, 32))
    assert not torch.equal(got, apply_rope(t, rope_factors(freqs, _config()), _config()))
    factors = rope_factors(freqs, _config())
    assert factors.tables(torch.bfloat16) is factors.tables(torch.bfloat16)
    assert rope_factors(None, _config()) is None


def test_apply_rope_launches_fewer_kernels_than_megatrons():
    """One bf16 [T, H, 32] tensor with 16 rotated channels, forward + backward: Megatron's
    unfused RoPE launches 20 kernels on the CPU count; ours 10 once the layer call's factors
    (cos, sin, 2 casts, neg, cat: once for the four tensors of an MSA layer) are built."""
    t, freqs, grad = _inputs(torch.bfloat16, 16, 2, 32, 16, seed=2)
    config = _config()
    counts = []
    for ours in (False, True):
        x = t.clone().requires_grad_()
        factors = rope_factors(freqs, config)
        if ours:
            factors.tables(torch.bfloat16)
        with OpCounter() as ops:
            out = (apply_rope(x, factors, config) if ours
                   else apply_rotary_pos_emb(x, freqs, config=config, cp_group=_CP))
            out.backward(grad)
        counts.append(ops.total)
    megatron, ours = counts
    assert ours <= 10 < megatron, (megatron, ours)
