"""The by-product indexer loss's backward in Triton (d index_q by a gather of the argmax keys,
d index_k by atomic adds) equals the torch version: the raw gradients in fp32 with unused slots
and many slots sharing one key, and the loss's gradients in bf16 through autograd, where the
deterministic-algorithms switch selects the torch version."""

from __future__ import annotations

import pytest
import torch
from _msa_support import KERNEL_DEVICE

from nemo_msa.indexer_loss import sparse_indexer_loss_from_byproducts
from nemo_msa.indexer_loss.byproducts import _fused, _gather_scatter_grads
from nemo_msa.indexer_loss.triton_byproducts import byproduct_grads_triton
from nemo_msa.testing.oracle import rel_err


@pytest.mark.parametrize(("tokens", "heads", "top_k", "dim"), [(70, 2, 4, 16), (33, 4, 3, 32)])
def test_raw_gradients_equal_the_torch_version(tokens, heads, top_k, dim):
    gen = torch.Generator().manual_seed(tokens)
    dscore = torch.randn(heads, tokens, top_k, generator=gen)
    # Few distinct keys (collisions for the atomic adds) and unused slots.
    keys = torch.randint(0, 9, (heads, tokens, top_k), generator=gen, dtype=torch.int32)
    keys[torch.rand(heads, tokens, top_k, generator=gen) < 0.3] = -1
    iq = torch.randn(tokens, heads, dim, generator=gen)
    ik = torch.randn(tokens, dim, generator=gen)
    args = [x.to(KERNEL_DEVICE) for x in (dscore, keys, iq, ik)]
    dq, dk = byproduct_grads_triton(*args)
    want_q, want_k = _gather_scatter_grads(*args)
    assert rel_err(dq.cpu(), want_q.cpu()) < 1e-6 and rel_err(dk.cpu(), want_k.cpu()) < 1e-6
    assert dk[9:].abs().sum() == 0  # only the keys used receive a gradient


def test_loss_gradients_bf16_fused_and_torch():
    gen = torch.Generator().manual_seed(1)
    tokens, heads, top_k, dim = 48, 2, 4, 32
    iq = torch.randn(tokens, heads, dim, generator=gen).to(KERNEL_DEVICE, torch.bfloat16)
    ik = torch.randn(tokens, dim, generator=gen).to(KERNEL_DEVICE, torch.bfloat16)
    scores = torch.randn(heads, tokens, top_k, generator=gen) * 3
    keys = torch.randint(0, tokens, (heads, tokens, top_k), generator=gen, dtype=torch.int32)
    keys[:, :, -1] = -1
    scores[:, :, -1] = -float("inf")
    mass = torch.rand(heads, tokens, top_k, generator=gen)
    mass[:, :, -1] = 0
    mass = mass / mass.sum(-1, keepdim=True)
    extra = [x.to(KERNEL_DEVICE) for x in (scores, keys, mass)]
    assert _fused(extra[0], iq)
    grads = []
    for deterministic in (False, True):
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        try:
            assert _fused(extra[0], iq) is not deterministic
            q, k = iq.clone().requires_grad_(), ik.clone().requires_grad_()
            loss, _ = sparse_indexer_loss_from_byproducts(
                q, k, *extra, num_index_heads_total=heads, loss_coeff=1.0)
            loss.backward()
            grads.append((q.grad.float().cpu(), k.grad.float().cpu()))
        finally:
            torch.use_deterministic_algorithms(previous)
    for a, b in zip(*grads, strict=True):
        assert torch.isfinite(a).all() and rel_err(a, b) < 1e-2
