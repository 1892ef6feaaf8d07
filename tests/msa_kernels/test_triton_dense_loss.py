"""The fused dense indexer loss (Triton) vs the chunked reference in float64.

``dense_indexer_loss_triton`` must compute ``compute_indexer_loss(..., sparse=False,
score_type="max")``: the KL value, the gradients of index_q and index_k, and the exact selection
recall, on packed documents of every length (shorter than a block, a block plus one, several
blocks), GQA groups that are and are not powers of two, and several block sizes. The kernels run
under the interpreter on CPU-only machines and compiled on a CUDA GPU; the reference runs in
float64 on the host on the same bf16-valued inputs.
"""

from __future__ import annotations

import pytest
import torch
from _msa_support import KERNEL_DEVICE

from nemo_msa import MSAMicrobatch
from nemo_msa.backends.capabilities import TRITON
from nemo_msa.indexer_loss import (
    compute_indexer_loss,
    dense_indexer_loss_triton,
)
from nemo_msa.selection import select_blocks_reference
from nemo_msa.testing.packs import document_map_from_lengths


def _layout(rows: list[list[int]], seq_len: int, block_size: int, device) -> MSAMicrobatch:
    return MSAMicrobatch.from_document_map(document_map_from_lengths(rows, seq_len, device),
                                           block_size=block_size)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _inputs(tokens, heads, group, dim, index_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    return (
        torch.randn(tokens, heads, index_dim, generator=gen).to(bf),  # index_q
        torch.randn(tokens, index_dim, generator=gen).to(bf),  # index_k
        (torch.randn(tokens, heads * group, dim, generator=gen) * 2).to(bf),  # query
        torch.randn(tokens, heads, dim, generator=gen).to(bf),  # key
    )


def _fused(inputs, msa, scale, coeff, q2k=None):
    iq, ik, q, k = (x.to(KERNEL_DEVICE).clone() for x in inputs)
    iq.requires_grad_(True)
    ik.requires_grad_(True)
    loss, stats = dense_indexer_loss_triton(
        iq, ik, q, k, msa, softmax_scale=scale, num_index_heads_total=iq.shape[1],
        loss_coeff=coeff, q2k=None if q2k is None else q2k.to(KERNEL_DEVICE))
    loss.backward()
    return loss.detach().cpu(), {n: v.cpu() for n, v in stats.items()}, iq.grad.cpu(), \
        ik.grad.cpu()


def _reference(inputs, msa, scale, coeff, q2k=None):
    iq, ik, q, k = (x.double() for x in inputs)
    iq.requires_grad_(True)
    ik.requires_grad_(True)
    loss, stats = compute_indexer_loss(
        iq, ik, q, k, msa, softmax_scale=scale, num_index_heads_total=iq.shape[1],
        loss_coeff=coeff, score_type="max", q2k=q2k, query_chunk=64)
    loss.backward()
    return loss.detach(), stats, iq.grad, ik.grad


@pytest.mark.parametrize(
    "rows,seq_len,bs,heads,group,dim,index_dim",
    [
        ([[70, 33, 150, 1]], 260, 32, 2, 3, 32, 16),
        ([[16, 17], [96]], 100, 16, 1, 4, 16, 32),
        ([[200], [65, 64]], 200, 64, 2, 2, 64, 16),
        ([[130, 5]], 140, 128, 1, 1, 16, 16),
    ],
)
def test_dense_loss_matches_float64_reference(rows, seq_len, bs, heads, group, dim, index_dim):
    msa_host = _layout(rows, seq_len, bs, "cpu")
    msa = _layout(rows, seq_len, bs, KERNEL_DEVICE)
    inputs = _inputs(msa_host.num_tokens, heads, group, dim, index_dim, seed=seq_len + bs)
    q2k = select_blocks_reference(inputs[0].double(), inputs[1].double(), msa_host, top_k=3,
                                  init_blocks=0, local_blocks=1, score="max")
    loss, stats, dq, dk = _fused(inputs, msa, 0.3, 0.7, q2k)
    ref, ref_stats, rdq, rdk = _reference(inputs, msa_host, 0.3, 0.7, q2k)
    assert torch.isfinite(loss) and float(loss) > 0
    # fp32 sums of terms of both signs (sum P log P - sum P s + sum P lse): 1e-4 of a small KL.
    assert _rel(loss, ref) < 1e-4
    assert _rel(stats["kl"], ref_stats["kl"]) < 1e-4
    # The gradients come back in bf16 (index_q's dtype): compare with the reference rounded so
    # (1.3e-6 on the interpreter, 1.3e-4 compiled: the argmax key's score is re-summed in the dq
    # kernel in another order, and a few elements round to the neighbouring bf16).
    assert _rel(dq, rdq.to(torch.bfloat16)) < 1e-3
    assert _rel(dk, rdk.to(torch.bfloat16)) < 1e-3
    assert _rel(dq, rdq) < 1e-2 and _rel(dk, rdk) < 1e-2
    assert _rel(stats["recall_mass"], ref_stats["recall_mass"]) < 1e-5
    assert float(stats["recall_count"]) == float(ref_stats["recall_count"])


def test_dense_loss_gradients_of_strided_index_inputs():
    """index_q and index_k as views with gaps between rows and heads: the gradients land in
    the right places (the kernels read by strides, d index_q is written densely)."""
    msa = _layout([[70, 30]], 100, 32, KERNEL_DEVICE)
    iq, ik, q, k = _inputs(msa.num_tokens, 2, 2, 16, 16, seed=5)
    wide_q = torch.zeros(msa.num_tokens, 4, 16, dtype=iq.dtype)
    wide_q[:, ::2] = iq
    wide_k = torch.zeros(msa.num_tokens, 32, dtype=ik.dtype)
    wide_k[:, :16] = ik
    viq = wide_q.to(KERNEL_DEVICE)[:, ::2].requires_grad_(True)
    vik = wide_k.to(KERNEL_DEVICE)[:, :16].requires_grad_(True)
    assert not viq.is_contiguous() and not vik.is_contiguous()
    loss, _ = dense_indexer_loss_triton(viq, vik, q.to(KERNEL_DEVICE), k.to(KERNEL_DEVICE), msa,
                                        softmax_scale=0.3, num_index_heads_total=2,
                                        loss_coeff=1.0)
    loss.backward()
    ref, _, rdq, rdk = _reference((iq, ik, q, k), _layout([[70, 30]], 100, 32, "cpu"), 0.3, 1.0)
    assert _rel(loss.detach().cpu(), ref) < 1e-4
    assert _rel(viq.grad.cpu(), rdq.to(torch.bfloat16)) < 1e-3
    assert _rel(vik.grad.cpu(), rdk.to(torch.bfloat16)) < 1e-3


def test_dense_loss_propagates_nan():
    msa = _layout([[40, 9]], 50, 16, KERNEL_DEVICE)
    iq, ik, q, k = _inputs(msa.num_tokens, 1, 2, 16, 16, seed=3)
    q[20, 1, 3] = float("nan")
    loss, stats, dq, _ = _fused((iq, ik, q, k), msa, 0.3, 1.0)
    assert torch.isnan(loss)
    assert torch.isnan(stats["kl"])


def test_dense_loss_refuses_shapes_and_second_backward():
    msa = _layout([[40]], 40, 16, KERNEL_DEVICE)
    iq, ik, q, k = (x.to(KERNEL_DEVICE) for x in _inputs(40, 1, 2, 16, 16, seed=1))
    assert "params dtype torch.float32" in TRITON.why_not_fused_dense_loss(
        dtype=torch.float32, head_dim=16, index_head_dim=16, block_size=16, group=2,
        score_type="max")
    assert "msa_block_size=256" in TRITON.why_not_fused_dense_loss(
        dtype=torch.bfloat16, head_dim=16, index_head_dim=16, block_size=256, group=2,
        score_type="max")
    assert "32 query heads per KV head" in TRITON.why_not_fused_dense_loss(
        dtype=torch.bfloat16, head_dim=16, index_head_dim=16, block_size=16, group=32,
        score_type="max")
    with pytest.raises(ValueError, match="cannot run params dtype torch.float32"):
        dense_indexer_loss_triton(iq.float(), ik.float(), q.float(), k.float(), msa,
                                  softmax_scale=0.3, num_index_heads_total=1, loss_coeff=1.0)
    with pytest.raises(ValueError, match="index_q dtype torch.bfloat16 differs"):
        dense_indexer_loss_triton(iq, ik, q.float(), k, msa, softmax_scale=0.3,
                                  num_index_heads_total=1, loss_coeff=1.0)
    iq.requires_grad_(True)
    loss, _ = dense_indexer_loss_triton(iq, ik, q, k, msa, softmax_scale=0.3,
                                        num_index_heads_total=1, loss_coeff=1.0)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backs up once"):
        loss.backward()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [[[4096]], [[1000, 3000, 96]]])
def test_dense_loss_production_shape_on_gpu(rows):
    """MiniMax-M3's shape (16 query heads per KV head, d 128, index d 128, block 128)."""
    seq_len = sum(rows[0])
    msa = _layout(rows, seq_len, 128, "cuda")
    inputs = _inputs(msa.num_tokens, 4, 16, 128, 128, seed=11)
    q2k = select_blocks_reference(inputs[0].double().cuda(), inputs[1].double().cuda(), msa,
                                  top_k=16, init_blocks=1, local_blocks=2, score="max")
    loss, stats, dq, dk = _fused(inputs, msa, 128 ** -0.5, 1.0, q2k)
    ref, ref_stats, rdq, rdk = _reference(tuple(x.cuda() for x in inputs), msa, 128 ** -0.5,
                                          1.0, q2k)
    assert torch.isfinite(loss)
    assert _rel(loss, ref.cpu()) < 1e-3
    assert _rel(dq, rdq.cpu().to(torch.bfloat16)) < 1e-3
    assert _rel(dk, rdk.cpu().to(torch.bfloat16)) < 1e-3
    assert _rel(stats["recall_mass"], ref_stats["recall_mass"].cpu()) < 1e-4
