"""Context parallelism simulated in one process: N ranks' query subsets against the unsplit ops.

Every rank r of N holds the load-balanced chunks r and 2N-1-r of each row; its queries are
scored, attended and distilled against every token's keys. The contract (MSA_SPEC.md): each
token's selected blocks, output, loss contribution and gradients equal the unsplit computation's
(sums over ranks for the key side). float64 on the reference backend.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from nemo_msa import MSAMicrobatch
from nemo_msa.attention.dense import dense_document_attention, query_runs
from nemo_msa.attention.naive import (
    sparse_attention_backward_reference,
    sparse_attention_forward_reference,
)
from nemo_msa.backends.registry import get_backend
from nemo_msa.context_parallel import (
    ContextParallelLayout,
    gather_order,
    load_balanced_indices,
    split_for_context_parallel,
    thd_document_map,
    thd_load_balanced_indices,
)
from nemo_msa.indexer_loss import (
    compute_indexer_loss,
    sampled_selection_recall,
    sparse_indexer_loss_from_byproducts,
)
from nemo_msa.ops import document_attention, select_blocks, sparse_attention
from nemo_msa.testing.packs import document_map_from_lengths

BLOCK = 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _cases():
    # S = 64 per row; N = 2 chunks of 16, N = 4 chunks of 8: documents straddle chunk
    # boundaries, some are shorter than a chunk (3, 5), rows end in padding.
    return [
        [[37, 3, 20], [5, 50, 1]],
        [[64], [9, 9, 9, 9, 9, 9, 5]],
    ]


def _ranks(msa: MSAMicrobatch, cp_size: int) -> list[ContextParallelLayout]:
    local = [load_balanced_indices(msa.seq_len, cp_size, r) for r in range(cp_size)]
    order = gather_order(local)
    return [ContextParallelLayout.from_global(msa, local[r], order, cp_size, r)
            for r in range(cp_size)]


def test_index_maps_follow_megatron():
    assert load_balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert thd_load_balanced_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    x = torch.arange(16).view(2, 8)
    assert split_for_context_parallel(x, 1, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    with pytest.raises(ValueError, match="multiple of 2 \\* context_parallel_size = 4"):
        load_balanced_indices(6, 2, 0)
    with pytest.raises(ValueError, match="sequence 0 6 tokens"):
        thd_load_balanced_indices(torch.tensor([0, 6]), 2, 0)
    # Without a split (CP = 1) any length runs, an odd document's included (ADR 0052).
    assert load_balanced_indices(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    odd = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert thd_load_balanced_indices(odd, 1, 0).tolist() == list(range(9))


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("rows", _cases())
def test_queries_partition_the_tokens(rows, cp_size):
    msa = MSAMicrobatch.from_document_map(document_map_from_lengths(rows, 64), block_size=BLOCK)
    ranks = _ranks(msa, cp_size)
    allq = torch.cat([r.queries for r in ranks])
    assert sorted(allq.tolist()) == list(range(msa.num_tokens))
    x = torch.randn(64, 2, 3, dtype=torch.float64)  # global [S, b, ...]
    packed = msa.pack(x.transpose(0, 1))
    for r, layout in enumerate(ranks):
        assert bool((layout.queries[1:] > layout.queries[:-1]).all())
        local = split_for_context_parallel(x, 0, cp_size, r)
        torch.testing.assert_close(layout.pack_local(local), packed[layout.queries])
        back = layout.unpack_local(layout.pack_local(local))
        real = layout.unpack_local(torch.ones(layout.num_queries, 1, dtype=torch.float64))
        torch.testing.assert_close(back, local * real)


@pytest.mark.parametrize(
    ("rows", "in_order"),
    [([[40, 24]], True), ([[64]], True), ([[40, 20]], False), ([[64], [64]], False)],
)
def test_rows_in_order_reshape_like_the_gather(rows, in_order):
    # One row without padding: the compact tokens are the Megatron rows themselves, so pack /
    # unpack reshape; padding or a second row keeps the gather. Values and gradients equal the
    # gather's either way (the gather path is what local_rows computes).
    msa = MSAMicrobatch.from_document_map(document_map_from_lengths(rows, 64), block_size=BLOCK)
    (layout,) = _ranks(msa, 1)
    assert layout.rows_in_order is in_order
    gathered = dataclasses.replace(layout, rows_in_order=False)
    # A strided view, as Megatron's key and value are slices of the fused QKV projection.
    fused = torch.randn(64, msa.batch_size, 5, 3, dtype=torch.float64, requires_grad=True)
    x = fused[..., 1:3, :]
    out = layout.pack_local(x)
    ref = gathered.pack_local(x)
    assert out.is_contiguous() and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    grad = torch.randn_like(ref)
    (g_out,) = torch.autograd.grad(out, fused, grad)
    (g_ref,) = torch.autograd.grad(ref, fused, grad)
    torch.testing.assert_close(g_out, g_ref, rtol=0, atol=0)
    y = torch.randn(layout.num_queries, 6, dtype=torch.float64, requires_grad=True)
    back, back_ref = layout.unpack_local(y), gathered.unpack_local(y)
    assert back.shape == back_ref.shape == (64, msa.batch_size, 6)
    torch.testing.assert_close(back, back_ref, rtol=0, atol=0)
    grad = torch.randn_like(back_ref)
    torch.testing.assert_close(torch.autograd.grad(back, y, grad)[0],
                               torch.autograd.grad(back_ref, y, grad)[0], rtol=0, atol=0)


def _inputs(msa, generator, heads=4, kv_heads=2, dim=16, index_dim=8):
    t = msa.num_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return rnd(t, heads, dim), rnd(t, kv_heads, dim), rnd(t, kv_heads, dim), rnd(
        t, kv_heads, index_dim), rnd(t, index_dim)


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("rows", _cases())
def test_selection_attention_and_losses_match_the_unsplit_ops(rows, cp_size):
    msa = MSAMicrobatch.from_document_map(
        document_map_from_lengths(rows, 64), block_size=BLOCK, init_blocks=1, local_blocks=1)
    gen = torch.Generator().manual_seed(cp_size)
    q, k, v, iq, ik = _inputs(msa, gen)
    scale = 0.3
    ids = select_blocks(iq, ik, msa, top_k=3, backend="reference")
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)

    out_full, lse_full, mass_full = sparse_attention_forward_reference(
        q, k, v, ids, msa, scale, return_block_mass=True)
    dq_full, dk_full, dv_full = sparse_attention_backward_reference(
        dout, q, k, v, out_full, lse_full, ids, msa, scale)
    dense_full = dense_document_attention(q, k, v, msa, scale)
    loss_dense_full, st_dense_full = compute_indexer_loss(
        iq, ik, q, k, msa, softmax_scale=scale, num_index_heads_total=2, loss_coeff=1.0,
        q2k=ids)
    loss_sparse_full, _ = compute_indexer_loss(
        iq, ik, q, k, msa, softmax_scale=scale, num_index_heads_total=2, loss_coeff=1.0,
        q2k=ids, sparse=True)
    recall_full = sampled_selection_recall(q, k, ids, msa, softmax_scale=scale, num_rows=10**6)

    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    losses = torch.zeros(3, dtype=torch.float64)
    dik = torch.zeros_like(ik)
    dik_byproducts = torch.zeros_like(ik)
    covered = torch.zeros((), dtype=torch.float64)
    for layout in _ranks(msa, cp_size):
        qs = layout.queries
        lids = select_blocks(iq[qs], ik, msa, top_k=3, backend="reference", queries=qs)
        assert torch.equal(lids, ids[:, qs])
        out, lse, mass = sparse_attention_forward_reference(
            q[qs], k, v, lids, msa, scale, return_block_mass=True, queries=qs)
        assert _rel(out, out_full[qs]) < 1e-12 and _rel(mass, mass_full[:, qs]) < 1e-12
        assert torch.equal(lse, lse_full[:, qs])
        dq, dk_r, dv_r = sparse_attention_backward_reference(
            dout[qs], q[qs], k, v, out, lse, lids, msa, scale, queries=qs)
        assert _rel(dq, dq_full[qs]) < 1e-12
        dk += dk_r
        dv += dv_r
        # The masked reference path of document_attention (non-bf16) and the dense path.
        masked = document_attention(q[qs], k, v, msa, softmax_scale=scale, q2k=lids, queries=qs)
        assert _rel(masked, out_full[qs]) < 1e-12
        dense = document_attention(q[qs], k, v, msa, softmax_scale=scale, queries=qs)
        assert _rel(dense, dense_full[qs]) < 1e-12
        # Indexer losses: the ranks' shares add up to the unsplit loss.
        liq, lik = iq[qs].clone().requires_grad_(), ik.clone().requires_grad_()
        ld, st = compute_indexer_loss(liq, lik, q[qs], k, msa, softmax_scale=scale,
                                      num_index_heads_total=2, loss_coeff=1.0, q2k=lids,
                                      queries=qs)
        ls, _ = compute_indexer_loss(iq[qs], ik, q[qs], k, msa, softmax_scale=scale,
                                     num_index_heads_total=2, loss_coeff=1.0, q2k=lids,
                                     sparse=True, queries=qs)
        lb, _ = sparse_indexer_loss_from_byproducts(
            liq, lik, lids, mass, msa, num_index_heads_total=2, loss_coeff=1.0,
            queries=qs)
        losses += torch.stack([ld.detach(), ls.detach(), lb.detach()])
        ld.backward()
        dik += lik.grad
        lib = ik.clone().requires_grad_()
        lb2, _ = sparse_indexer_loss_from_byproducts(
            iq[qs], lib, lids, mass, msa, num_index_heads_total=2, loss_coeff=1.0,
            queries=qs)
        lb2.backward()
        dik_byproducts += lib.grad
        covered += sampled_selection_recall(q[qs], k, lids, msa, softmax_scale=scale,
                                            num_rows=10**6, queries=qs)["recall_mass"]
        assert float(st["recall_count"]) == qs.numel() * 2
    assert _rel(dk, dk_full) < 1e-12 and _rel(dv, dv_full) < 1e-12
    assert abs(float(losses[0]) - float(loss_dense_full)) < 1e-12 * max(1, abs(float(
        loss_dense_full)))
    assert math.isclose(float(losses[1]), float(loss_sparse_full), rel_tol=1e-10)
    assert math.isclose(float(losses[2]), float(loss_sparse_full), rel_tol=1e-10)
    assert math.isclose(float(covered), float(recall_full["recall_mass"]), rel_tol=1e-10)
    assert math.isclose(float(covered), float(st_dense_full["recall_mass"]), rel_tol=1e-10)
    # d index_k of the dense loss, summed over ranks (what the reduce-scatter does).
    ikf = ik.clone().requires_grad_()
    compute_indexer_loss(iq, ikf, q, k, msa, softmax_scale=scale, num_index_heads_total=2,
                         loss_coeff=1.0)[0].backward()
    assert ikf.grad.abs().sum() > 0 and _rel(dik, ikf.grad) < 1e-10
    ikb = ik.clone().requires_grad_()
    sparse_indexer_loss_from_byproducts(iq, ikb, ids, mass_full, msa,
                                        num_index_heads_total=2, loss_coeff=1.0)[0].backward()
    assert ikb.grad.abs().sum() > 0 and _rel(dik_byproducts, ikb.grad) < 1e-10


def test_dense_query_runs_follow_documents():
    msa = MSAMicrobatch.from_document_map(document_map_from_lengths([[37, 3, 20]], 64),
                                          block_size=BLOCK)
    layout = _ranks(msa, 2)[0]  # columns 0..15 and 48..63
    runs = query_runs(msa, layout.queries)
    assert [(r.count, r.key_start, r.key_stop) for r in runs] == [(16, 0, 16), (12, 40, 60)]


def test_thd_document_map_marks_the_padding_gap():
    ids = thd_document_map(torch.tensor([0, 3, 8]), torch.tensor([0, 4, 12]))
    assert ids.tolist() == [[1, 1, 1, 0, 2, 2, 2, 2, 2, 0, 0, 0]]
    with pytest.raises(ValueError, match="longer in cu_seqlens_q"):
        thd_document_map(torch.tensor([0, 5]), torch.tensor([0, 4]))


def test_backend_without_query_subset_refuses():
    msa = MSAMicrobatch.from_document_map(document_map_from_lengths([[20]], 32), block_size=16)
    reference = get_backend("reference")
    # A resolved backend whose record declares no query subset (the ops take it as it is).
    stub = dataclasses.replace(reference, name="cp_test_stub", capabilities=dataclasses.replace(
        reference.capabilities, query_subset=False))
    iq, ik = torch.randn(10, 1, 8), torch.randn(20, 8)
    with pytest.raises(NotImplementedError, match="'cp_test_stub' backend has no query-subset"):
        select_blocks(iq, ik, msa, top_k=2, backend=stub, queries=torch.arange(10))


def test_bf16_op_with_queries_matches_rows_of_the_unsplit_op():
    msa = MSAMicrobatch.from_document_map(document_map_from_lengths([[37, 3, 20]], 64),
                                          block_size=BLOCK)
    gen = torch.Generator().manual_seed(3)
    q, k, v, iq, ik = (x.to(torch.bfloat16) for x in _inputs(msa, gen))
    ids = select_blocks(iq, ik, msa, top_k=2, backend="reference")
    full = sparse_attention(q, k, v, ids, msa, backend="reference")
    layout = _ranks(msa, 2)[1]
    qs = layout.queries
    lk = k.clone().requires_grad_()
    out = sparse_attention(q[qs], lk, v, ids[:, qs], msa, backend="reference", queries=qs)
    assert _rel(out.double(), full[qs].double()) < 1e-2
    out.float().sum().backward()
    assert lk.grad.shape == k.shape and bool(torch.isfinite(lk.grad.float()).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuDNN SDPA)")
def test_dense_query_subset_on_cuda_matches_the_unsplit_kernel():
    """bf16 on CUDA: local queries against every token's keys (lower-right causal SDPA per run)
    equal the rows of the per-document cuDNN path, forward and key/value gradients summed."""
    ids = document_map_from_lengths([[700, 3, 300], [1024]], 1024, device="cuda")
    msa = MSAMicrobatch.from_document_map(ids, block_size=128)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = msa.num_tokens
    q, k, v = (torch.randn(t, h, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
               for h in (16, 4, 4))
    full = dense_document_attention(q, k, v, msa, 0.088)
    for layout in _ranks(msa, 4):
        qs = layout.queries
        out = dense_document_attention(q[qs], k, v, msa, 0.088, queries=qs)
        assert _rel(out.double(), full[qs].double()) < 2e-2
