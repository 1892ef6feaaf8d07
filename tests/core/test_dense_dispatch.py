"""The dense dispatch (ADR 0026): a layer's core attention with a top-k selection runs the document
prefixes (every visible block selected) densely and the rest sparsely, and computes what the
all-sparse path computes: outputs, gradients of q/k/v, the block mass, and the sparse indexer loss
and the gradients of index q/k built on them (float64, the reference backend, random packed
documents: shorter than top_k * block, straddling it, longer, with padding)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from nemo_msa import MSAMicrobatch, ops, select_blocks, sparse_attention
from nemo_msa.attention.dense_dispatch import MIN_PREFIX_SHARE, dense_dispatch, prefix_share
from nemo_msa.indexer_loss import sparse_indexer_loss_from_byproducts
from nemo_msa.q2k import canonical_q2k, holds_every_candidate
from nemo_msa.testing.packs import document_map_from_lengths
from nemo_msa.triton.kernel_layout import build_query_subset, kernel_layout, query_subset

BLOCK, TOP_K = 16, 3  # prefixes of 48 tokens
HQ, HKV, D = 4, 2, 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _layout(seed: int, rows_of_lengths=None, seq_len=None, init_blocks=0, local_blocks=1):
    gen = torch.Generator().manual_seed(seed)
    if rows_of_lengths is None:
        # Lengths around the 48-token limit: below, at, just past, far past; some padding.
        choices = [1, 5, 16, 47, 48, 49, 64, 90, 130]
        rows_of_lengths = []
        for _ in range(2):
            n = int(torch.randint(1, 5, (1,), generator=gen))
            rows_of_lengths.append(
                [choices[int(i)] for i in torch.randint(len(choices), (n,), generator=gen)])
        seq_len = max(sum(r) for r in rows_of_lengths) + 3
    ids = document_map_from_lengths(rows_of_lengths, seq_len)
    return MSAMicrobatch.build(packed_seq_ids=ids, block_size=BLOCK, init_blocks=init_blocks,
                               local_blocks=local_blocks), gen


def _inputs(msa, gen):
    t = msa.num_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    return (rnd(t, HQ, D), rnd(t, HKV, D), rnd(t, HKV, D), rnd(t, HKV, D), rnd(t, D),
            torch.randn(t, HQ, D, generator=gen, dtype=torch.float64))


def _step(msa, q, k, v, iq, ik, dout, dispatch: bool, expect_dispatch: bool | None = None):
    """Forward + backward of the attention and the by-product indexer loss; all-sparse when
    ``dispatch`` is False (the selection handed over as a copy, which claims no selection)."""
    for x in (q, k, v, iq, ik):
        x.grad = None
    q2k, scores, keys = select_blocks(iq.detach(), ik.detach(), msa, top_k=TOP_K,
                                      backend="reference", return_scores=True)
    assert holds_every_candidate(q2k, BLOCK)
    if not dispatch:
        q2k = q2k.clone()
        assert not holds_every_candidate(q2k, BLOCK)
    with mock.patch.object(ops, "dispatched_attention", wraps=ops.dispatched_attention) as spy:
        out, mass = ops.document_attention(q, k, v, msa, softmax_scale=D**-0.5, q2k=q2k,
                                       backend="reference", return_block_mass=True)
    assert spy.call_count == int(dispatch if expect_dispatch is None else expect_dispatch)
    loss, _ = sparse_indexer_loss_from_byproducts(
        iq, ik, scores, keys, mass, num_index_heads_total=HKV, loss_coeff=1.0)
    ((out * dout).sum() + loss).backward()
    return out.detach(), mass, loss.detach(), [x.grad.clone() for x in (q, k, v, iq, ik)]


@pytest.mark.parametrize("seed", range(6))
def test_dispatch_equals_all_sparse_float64(seed):
    msa, gen = _layout(seed)
    args = _inputs(msa, gen)
    out_d, mass_d, loss_d, grads_d = _step(msa, *args, dispatch=True)
    out_s, mass_s, loss_s, grads_s = _step(msa, *args, dispatch=False)
    assert _rel(out_d, out_s) < 1e-12
    assert _rel(mass_d, mass_s) < 1e-12
    assert abs(float(loss_d - loss_s)) <= 1e-12 * abs(float(loss_s))
    for name, a, b in zip(("q", "k", "v", "index_q", "index_k"), grads_d, grads_s, strict=True):
        assert _rel(a, b) < 1e-12, name


@pytest.mark.parametrize("forced", [(0, 1), (1, 1), (2, 0), (1, 2)])
def test_forced_blocks_do_not_change_the_split(forced):
    # Whatever the forced blocks, a query with at most top_k candidates selects them all.
    msa, gen = _layout(11, [[40, 100, 7], [130]], 150, *forced)
    args = _inputs(msa, gen)
    out_d, mass_d, _, grads_d = _step(msa, *args, dispatch=True)
    out_s, mass_s, _, grads_s = _step(msa, *args, dispatch=False)
    assert _rel(out_d, out_s) < 1e-12 and _rel(mass_d, mass_s) < 1e-12
    assert all(_rel(a, b) < 1e-12 for a, b in zip(grads_d, grads_s, strict=True))


@pytest.mark.parametrize(("lengths", "in_order"), [
    ([[130]], True), ([[30, 7, 100]], True), ([[100, 30]], False), ([[60], [60]], False)])
def test_in_order_and_interleaved_splits(lengths, in_order):
    msa, gen = _layout(2, lengths, 140)
    assert dense_dispatch(msa, TOP_K).in_order is in_order
    args = _inputs(msa, gen)
    out_d, mass_d, _, grads_d = _step(msa, *args, dispatch=True)
    out_s, mass_s, _, grads_s = _step(msa, *args, dispatch=False)
    assert _rel(out_d, out_s) < 1e-12 and _rel(mass_d, mass_s) < 1e-12
    assert all(_rel(a, b) < 1e-12 for a, b in zip(grads_d, grads_s, strict=True))


def test_every_document_within_the_limit_is_all_dense():
    msa, gen = _layout(3, [[48, 1, 30], [17]], 80)
    plan = dense_dispatch(msa, TOP_K)
    assert plan.num_sparse == 0 and plan.num_dense == msa.num_tokens
    args = _inputs(msa, gen)
    out_d, mass_d, _, grads_d = _step(msa, *args, dispatch=True)
    out_s, mass_s, _, grads_s = _step(msa, *args, dispatch=False)
    assert _rel(out_d, out_s) < 1e-12 and _rel(mass_d, mass_s) < 1e-12
    assert all(_rel(a, b) < 1e-12 for a, b in zip(grads_d, grads_s, strict=True))


def test_plan_rows_runs_and_tile_counts():
    lengths = [[5, 48, 49, 130], [200, 47]]
    msa, _ = _layout(0, lengths, 260)
    plan = dense_dispatch(msa, TOP_K)
    assert dense_dispatch(msa, TOP_K) is plan  # once per layout
    positions = msa.document_positions.long()
    assert torch.equal(plan.dense_rows, torch.nonzero(positions < 48).squeeze(1))
    assert torch.equal(plan.sparse_rows, torch.nonzero(positions >= 48).squeeze(1))
    assert torch.equal(plan.order[plan.merge], torch.arange(msa.num_tokens))
    prefixes = [min(n, 48) for row in lengths for n in row]
    assert [(r.count, r.length) for r in plan.dense_runs] == [(1, 5), (4, 48), (1, 47)]
    assert sum(r.count * r.length for r in plan.dense_runs) == sum(prefixes) == plan.num_dense
    # The primed kernel views equal the ones built with the device's counts (a sync).
    view = kernel_layout(msa, BLOCK)
    for rows in (plan.dense_rows, plan.sparse_rows):
        primed, built = query_subset(msa, BLOCK, rows), build_query_subset(view, rows)
        assert primed.num_queries == built.num_queries
        assert set(primed.tiles) == set(built.tiles)
        for qt in built.tiles:
            assert torch.equal(primed.tiles[qt], built.tiles[qt]), qt
        assert torch.equal(primed.query_row, built.query_row)


def test_only_a_marked_selection_dispatches():
    # A hand-made q2k that misses a prefix block must keep its meaning (its set), so it takes
    # the sparse path even when made canonical.
    msa, gen = _layout(5, [[40, 70]], 110)
    q, k, v, iq, ik, _ = _inputs(msa, gen)
    q2k = select_blocks(iq.detach(), ik.detach(), msa, top_k=TOP_K, backend="reference")
    holey = q2k.clone()
    holey[:, 35, 0] = -1  # token 35 (position 35, blocks 0..2) loses block 0
    holey = canonical_q2k(holey, msa)
    assert not holds_every_candidate(holey, BLOCK)
    got = ops.document_attention(q, k, v, msa, softmax_scale=0.25, q2k=holey, backend="reference")
    want = sparse_attention(q, k, v, holey, msa, softmax_scale=0.25, backend="reference")
    assert _rel(got, want) < 1e-14
    full = sparse_attention(q, k, v, q2k, msa, softmax_scale=0.25, backend="reference")
    assert _rel(got[35], full[35]) > 1e-3  # the missing block matters


@pytest.mark.gpu
def test_dispatch_equals_all_sparse_bf16_triton_gpu():
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    lengths = [[300, 2048, 2049, 2500, 5000, 77, 128 * 16 - 1]]
    ids = document_map_from_lengths(lengths, sum(lengths[0]) + 5, device)
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=128)
    t = msa.num_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device,
                           dtype=torch.bfloat16).requires_grad_()

    q, k, v = rnd(t, 64, 128), rnd(t, 4, 128), rnd(t, 4, 128)
    iq, ik = rnd(t, 4, 128), rnd(t, 128)
    dout = torch.randn(t, 64, 128, generator=gen, device=device, dtype=torch.bfloat16)
    results = []
    for dispatch in (True, False):
        for x in (q, k, v, iq, ik):
            x.grad = None
        q2k, scores, keys = select_blocks(iq.detach(), ik.detach(), msa, top_k=16,
                                          backend="triton", return_scores=True)
        if not dispatch:
            q2k = q2k.clone()
        out, mass = ops.document_attention(q, k, v, msa, softmax_scale=128**-0.5, q2k=q2k,
                                       backend="triton", return_block_mass=True)
        loss, _ = sparse_indexer_loss_from_byproducts(
            iq, ik, scores, keys, mass, num_index_heads_total=4, loss_coeff=1.0)
        ((out.float() * dout.float()).sum() + loss).backward()
        results.append((out.float(), mass, loss.float(),
                        [x.grad.float() for x in (q, k, v, iq, ik)]))
    (out_d, mass_d, loss_d, grads_d), (out_s, mass_s, loss_s, grads_s) = results
    assert _rel(out_d, out_s) < 1e-2
    assert _rel(mass_d, mass_s) < 1e-2
    assert abs(float(loss_d - loss_s)) <= 1e-2 * abs(float(loss_s))
    for name, a, b in zip(("q", "k", "v", "index_q", "index_k"), grads_d, grads_s, strict=True):
        assert _rel(a, b) < 2e-2, name


@pytest.mark.parametrize("lengths", [[[130]], [[100, 30, 5], [64]]])
def test_without_block_mass(lengths):
    # The indexer loss off: no mass pass; outputs and gradients still equal the sparse path's.
    msa, gen = _layout(4, lengths, 140)
    q, k, v, iq, ik, dout = _inputs(msa, gen)
    q2k = select_blocks(iq.detach(), ik.detach(), msa, top_k=TOP_K, backend="reference")
    results = []
    for sel in (q2k, q2k.clone()):
        for x in (q, k, v):
            x.grad = None
        out = ops.document_attention(q, k, v, msa, softmax_scale=0.3, q2k=sel,
                                     backend="reference")
        out.backward(dout)
        results.append([out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    assert all(_rel(a, b) < 1e-12 for a, b in zip(*results, strict=True))


def test_little_prefix_work_stays_sparse():
    # One 1000-token document: its first 48 queries hold 2.5% of the sparse pairs.
    msa, gen = _layout(6, [[1000]], 1000)
    assert prefix_share(msa.document_lengths, TOP_K * BLOCK) < MIN_PREFIX_SHARE
    assert dense_dispatch(msa, TOP_K) is None
    assert dense_dispatch(msa, TOP_K, min_share=0.0).num_dense == 48
    args = _inputs(msa, gen)
    out_d, mass_d, _, grads_d = _step(msa, *args, dispatch=True, expect_dispatch=False)
    out_s, mass_s, _, grads_s = _step(msa, *args, dispatch=False)
    assert torch.equal(out_d, out_s) and torch.equal(mass_d, mass_s)


@pytest.mark.gpu
def test_dispatch_byproduct_loss_and_recall_add_no_synchronization_gpu():
    """After the layout's one sync, the dispatch plan, both sides of the attention, the mass,
    the by-product loss and its Triton backward, and the Triton recall never wait on the host
    (a fresh layout each round: the plan is built inside the checked region)."""
    import warnings

    from nemo_msa.indexer_loss import sampled_selection_recall

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    lengths = [[300, 2048, 1000, 700], [4000, 96]]
    t = sum(map(sum, lengths))

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device, torch.bfloat16).requires_grad_()

    q, k, v = rnd(t, 64, 128), rnd(t, 4, 128), rnd(t, 4, 128)
    iq, ik = rnd(t, 4, 128), rnd(t, 128)
    dout = torch.randn(t, 64, 128, generator=gen).to(device, torch.bfloat16)
    for _ in range(2):  # the first round compiles the kernels and plans cuDNN
        ids = document_map_from_lengths(lengths, 4096, device)
        msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=128)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught, mock.patch.object(
                    ops, "dispatched_attention", wraps=ops.dispatched_attention) as spy:
                warnings.simplefilter("always")
                q2k, scores, keys = select_blocks(iq.detach(), ik.detach(), msa, top_k=16,
                                                  backend="triton", return_scores=True)
                out, mass = ops.document_attention(q, k, v, msa, softmax_scale=128**-0.5,
                                                   q2k=q2k, backend="triton",
                                                   return_block_mass=True)
                loss, _ = sparse_indexer_loss_from_byproducts(
                    iq, ik, scores, keys, mass, num_index_heads_total=4, loss_coeff=1.0)
                stats = sampled_selection_recall(q, k, q2k, msa, softmax_scale=128**-0.5,
                                                 num_rows=256)
                ((out.float() * dout.float()).sum() + loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert spy.call_count == 1
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert syncs == []
    assert 0 < float(stats["recall_mass"]) <= float(stats["recall_count"])
