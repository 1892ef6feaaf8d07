"""The by-product indexer loss's fused forward (one Triton kernel: each row's KL and its unit
score gradient) against float64 references, and the whole loss (value, d index_q, d index_k)
of the fused path against the torch path in float64, on the by-products of the Triton selection
and sparse forward over random packed documents. Interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

import math

import pytest
import torch
from _msa_support import KERNEL_DEVICE, layout_on_kernel_device, make_layout

from nemo_msa import unplanned
from nemo_msa.backends.triton import BACKEND
from nemo_msa.indexer_loss import sparse_indexer_loss_from_byproducts
from nemo_msa.indexer_loss.byproducts import _EPS, _fused, sparse_kl_forward_reference
from nemo_msa.indexer_loss.triton_byproducts import sparse_kl_forward_triton
from nemo_msa.ops import document_attention, select_blocks
from nemo_msa.testing.oracle import rel_err


def _kl_inputs(heads, tokens, top_k, gen):
    """fp32 scores (-inf at unused slots, some rows with one used slot) and a target that is a
    distribution over the used slots with some zero entries."""
    scores = torch.randn(heads, tokens, top_k, generator=gen) * 4
    unused = torch.rand(heads, tokens, top_k, generator=gen) < 0.3
    unused[..., 0] = False  # every row has a used slot (its own block, in the kernels)
    unused[:, ::5, 1:] = True  # rows with one used slot
    scores[unused] = -math.inf
    target = torch.rand(heads, tokens, top_k, generator=gen)
    target[unused | (torch.rand(heads, tokens, top_k, generator=gen) < 0.2)] = 0
    target[..., 0] += 1e-3
    return scores, target / target.sum(-1, keepdim=True)


def _kl_f64(scores, target, scale):
    """float64 row KL and unit gradient, written out from the definitions."""
    s, p = scores.double() * scale, target.double()
    log_q = s - torch.logsumexp(s, -1, keepdim=True)
    kl = torch.where(p > 0, p * (torch.log(p) - log_q), 0.0).sum(-1)
    unit = (log_q.exp() * p.sum(-1, keepdim=True) - p) * scale
    return kl, unit


@pytest.mark.parametrize(("heads", "tokens", "top_k"), [(2, 70, 4), (3, 129, 16), (1, 5, 3)])
def test_fused_kl_forward_equals_the_float64_definition(heads, tokens, top_k):
    gen = torch.Generator().manual_seed(tokens)
    scores, target = _kl_inputs(heads, tokens, top_k, gen)
    scale = 1 / math.sqrt(32)
    want_kl, want_unit = _kl_f64(scores, target, scale)
    kl, unit = sparse_kl_forward_triton(scores.to(KERNEL_DEVICE), target.to(KERNEL_DEVICE),
                                        scale, _EPS)
    ref_kl, ref_unit = sparse_kl_forward_reference(scores.double(), target.double(), scale, _EPS)
    assert kl.dtype == unit.dtype == torch.float32
    assert torch.isfinite(kl).all() and torch.isfinite(unit.cpu()[scores > -math.inf]).all()
    used = scores > -math.inf  # the backward reads used slots only
    assert rel_err(kl.cpu().double(), want_kl) < 1e-5
    assert rel_err(unit.cpu().double()[used], want_unit[used]) < 1e-5
    assert rel_err(ref_kl, want_kl) < 1e-12 and rel_err(ref_unit[used], want_unit[used]) < 1e-12


def test_fused_kl_forward_spreads_nan_like_the_reference():
    gen = torch.Generator().manual_seed(3)
    scores, target = _kl_inputs(2, 20, 4, gen)
    scores[1, 7, 0] = math.nan
    kl, unit = sparse_kl_forward_triton(scores.to(KERNEL_DEVICE), target.to(KERNEL_DEVICE),
                                        0.25, _EPS)
    ref_kl, ref_unit = sparse_kl_forward_reference(scores, target, 0.25, _EPS)
    assert torch.equal(kl.cpu().isnan(), ref_kl.isnan()) and ref_kl.isnan().sum() == 1
    assert torch.equal(unit.cpu().isnan(), ref_unit.isnan())
    assert rel_err(kl.cpu()[~ref_kl.isnan()], ref_kl[~ref_kl.isnan()]) < 1e-6


@pytest.mark.parametrize(
    ("rows", "seq_len", "block", "top_k"),
    [([[1, 16, 33, 64, 5]], 128, 16, 2), ([[40, 1], [16, 57], [80]], 112, 16, 3)],
)
def test_fused_loss_and_gradients_equal_the_float64_torch_path(rows, seq_len, block, top_k):
    """The Triton selection and the sparse forward's block mass on random packed
    documents; the loss and the gradients of index_q / index_k through the fused kernels
    (bf16 index tensors) against the torch path on the same values in float64."""
    gen = torch.Generator().manual_seed(seq_len + top_k)
    msa = layout_on_kernel_device(make_layout(rows, seq_len, block))
    t, hkv, group, d, di = msa.num_tokens, 2, 2, 32, 32

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(KERNEL_DEVICE, torch.bfloat16)

    q, k, v = rand(t, hkv * group, d), rand(t, hkv, d), rand(t, hkv, d)
    iq, ik = rand(t, hkv, di), rand(t, di)
    selected = select_blocks(iq, ik, msa, top_k=top_k, backend=BACKEND)
    _, mass = document_attention(q, k, v, msa, softmax_scale=d**-0.5, q2k=selected,
                                 backend=BACKEND, return_block_mass=True)
    unplanned.reset()
    assert _fused(mass, iq, None)  # the device decides where no plan names the kernel: counted
    assert unplanned.counts() == {"loss_passes": 1}
    with pytest.raises(ValueError, match=r"MSAKernels.loss_passes=True but .*dtype torch.float32"):
        _fused(mass, iq.float(), True)  # a plan's kernel meeting inputs it did not foresee

    def loss_and_grads(index_q, index_k):
        index_q, index_k = index_q.clone().requires_grad_(), index_k.clone().requires_grad_()
        loss, _ = sparse_indexer_loss_from_byproducts(
            index_q, index_k, selected, mass, msa, num_index_heads_total=hkv, loss_coeff=0.7)
        loss.backward()
        return [x.detach().cpu().double() for x in (loss, index_q.grad, index_k.grad)]

    fused = loss_and_grads(iq, ik)
    reference = loss_and_grads(iq.double(), ik.double())
    assert all(torch.isfinite(x).all() for x in fused)
    assert reference[0] > 0 and rel_err(fused[0], reference[0]) < 1e-5
    # bf16 gradients (one rounding of fp32 sums) against float64.
    assert rel_err(fused[1], reference[1]) < 1e-2 and rel_err(fused[2], reference[2]) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernel)")
def test_fused_kl_forward_at_minimax_m3_shape_gpu():
    """Compiled at MiniMax-M3's by-product shape (4 index heads, 8192 tokens, top-16)."""
    gen = torch.Generator().manual_seed(0)
    scores, target = _kl_inputs(4, 8192, 16, gen)
    scale = 1 / math.sqrt(128)
    kl, unit = sparse_kl_forward_triton(scores.cuda(), target.cuda(), scale, _EPS)
    want_kl, want_unit = _kl_f64(scores, target, scale)
    used = scores > -math.inf
    assert rel_err(kl.cpu().double(), want_kl) < 1e-5
    assert rel_err(unit.cpu().double()[used], want_unit[used]) < 1e-5
