"""The sparse indexer loss's block-major passes in Triton (ADR 0033) equal the torch version:
each selected block's score and argmax key, d index_q by a gather of those keys and d index_k by
a one-hot MMA per block, on packed layouts with padding, dropped own blocks, slots past the own
block, blocks split into chunks, a query subset, NaN/Inf rows; and the loss's gradients
through autograd, fused and torch, with and without the deterministic switch."""

from __future__ import annotations

import pytest
import torch
from _msa_support import KERNEL_DEVICE, layout_on_kernel_device, make_layout, random_q2k

from nemo_msa import MSAMicrobatch, select_blocks
from nemo_msa.indexer_loss import byproducts as byproducts_module
from nemo_msa.indexer_loss import sparse_indexer_loss_from_byproducts
from nemo_msa.indexer_loss.byproducts import _gather_scatter_grads, block_scores_reference
from nemo_msa.indexer_loss.triton_byproducts import (
    block_scores_triton,
    byproduct_grads_triton,
    plan_chunk,
)
from nemo_msa.testing.oracle import rel_err
from nemo_msa.testing.packs import document_map_from_lengths


def _inputs(rows, seq_len, bs, heads, top_k, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    msa = make_layout(rows, seq_len, bs)
    t = msa.num_tokens
    q2k = random_q2k(msa, heads, top_k, bs, gen, drop_own=True)
    # A slot past the own block (out of contract): left out by both sides.
    q2k[0, -1, 0] = q2k[0, -1].max() + 1
    iq = torch.randn(t, heads, dim, generator=gen).to(torch.bfloat16)
    ik = torch.randn(t, dim, generator=gen).to(torch.bfloat16)
    dscore = torch.randn(heads, t, top_k, generator=gen)
    return msa, q2k, iq, ik, dscore


def _reference(msa, q2k, iq, ik, dscore, queries=None):
    scores, keys = block_scores_reference(iq.double(), ik.double(), q2k, msa, queries)
    dq, dk = _gather_scatter_grads(dscore, keys, iq.float(), ik.float())
    return dq, dk, keys, scores


def _triton(msa, q2k, iq, ik, dscore, queries=None, chunk=8192):
    """``(dq, dk, keys, scores)`` of the two block-major passes, on the kernels' device."""
    dev = layout_on_kernel_device(msa)
    q2k, iq, ik, dscore = (x.to(KERNEL_DEVICE) for x in (q2k, iq, ik, dscore))
    queries = None if queries is None else queries.to(KERNEL_DEVICE)
    scores, keys, plan = block_scores_triton(iq, ik, q2k, dev, queries, chunk=chunk)
    dq, dk = byproduct_grads_triton(dscore, keys, iq, ik, dev, plan)
    return dq, dk, keys, scores, plan


def _finite_parts_close(got, want, tol):
    """Same NaN and +-Inf positions, and the finite rest within ``tol`` (relative norm)."""
    got = got.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isposinf(got), torch.isposinf(want))
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    assert rel_err(got[fin], want[fin]) < tol


_SMALL = ([[70, 5], [33, 64]], 128, 16, 2, 3, 16)
_LARGE = ([[150, 3], [97]], 160, 32, 3, 4, 32)


# Chunks of 5 slots (blocks of one chunk and split ones) on the small shape only: on the large
# one they repeat its path at several times the interpreter's cost (ADR 0038).
@pytest.mark.parametrize(("rows", "seq_len", "bs", "heads", "top_k", "dim", "chunk"), [
    (*_SMALL, 8192), (*_SMALL, 5), (*_SMALL, None), (*_LARGE, 8192), (*_LARGE, None),
], ids=["small-8192", "small-5", "small-default", "large-8192", "large-default"])
def test_keys_and_gradients_equal_the_torch_version(rows, seq_len, bs, heads, top_k, dim, chunk):
    msa, q2k, iq, ik, dscore = _inputs(rows, seq_len, bs, heads, top_k, dim,
                                       seq_len + (chunk or 1))
    want_q, want_k, want_keys, want_scores = _reference(msa, q2k, iq, ik, dscore)
    dq, dk, keys, scores, plan = _triton(msa, q2k, iq, ik, dscore, chunk=chunk)
    if chunk is None:  # the default: the slot count's chunk
        assert plan.chunk == plan_chunk(q2k.numel())
    chunks = (plan.offsets[1:] - plan.offsets[:-1] + plan.chunk - 1) // plan.chunk
    if chunk == 5:  # blocks of one chunk (written directly) and split ones (partials)
        assert bool((chunks == 1).any()) and bool((chunks > 1).any())
    assert keys.dtype == torch.int32 and torch.equal(keys.cpu(), want_keys)
    assert scores.dtype == torch.float32
    used = want_keys >= 0
    assert bool((scores.cpu()[~used] == -torch.inf).all())
    assert rel_err(scores.cpu()[used].double(), want_scores[used]) < 1e-6
    assert int((want_keys >= 0).sum()) > 0 and int((want_keys < 0).sum()) > 0
    assert dq.dtype == torch.bfloat16 and dk.dtype == torch.bfloat16
    assert rel_err(dq.float().cpu(), want_q) < 1e-2 and rel_err(dk.float().cpu(), want_k) < 1e-2
    # Keys no slot points at get exactly zero.
    unused = torch.ones(msa.num_tokens, dtype=torch.bool)
    unused[want_keys[want_keys >= 0].long()] = False
    assert unused.any() and bool((dk.cpu()[unused] == 0).all())
    # No atomics: a second run gives the same bits (asked once: on split blocks, whose
    # partial sums are added by a second kernel; the others run the same kernels).
    if chunk == 5:
        again = _triton(msa, q2k, iq, ik, dscore, chunk=chunk)
        assert all(torch.equal(a, b)
                   for a, b in zip((dq, dk, keys, scores), again[:4], strict=True))


def test_plan_chunk_gives_short_rows_several_chunks_per_sm():
    """The default chunk: a power of two in [1024, 8192], making about 512 chunks (four per SM
    of an H100/H200) where the slots allow; capped at 8192 for long rows."""
    heads, top_k = 4, 16  # MiniMax-M3's index heads and top_k
    assert plan_chunk(heads * 8192 * top_k) == 1024
    assert plan_chunk(heads * 32768 * top_k) == 4096
    assert plan_chunk(heads * 131072 * top_k) == 8192
    assert plan_chunk(0) == plan_chunk(1) == 1024
    for slots in (1, 1000, 524_288, 524_289, 2_097_152, 10**9):
        chunk = plan_chunk(slots)
        assert chunk & (chunk - 1) == 0 and 1024 <= chunk <= 8192
        chunks = -(-slots // chunk)
        assert chunks <= 512 or chunk == 8192
        assert chunk == 1024 or chunks > 256  # a chunk half as large would exceed 512 chunks


def test_nonfinite_rows_reach_only_their_own_keys():
    msa, q2k, iq, ik, dscore = _inputs([[70, 5], [33, 64]], 128, 16, 2, 3, 16, 7)
    ik[40, 3] = float("nan")  # every query that scores key 40's block against it gets NaN
    iq[100, 1, 2] = float("inf")
    dscore[0, 60, 1] = float("-inf")
    want_q, want_k, want_keys, want_scores = _reference(msa, q2k, iq, ik, dscore)
    dq, dk, keys, scores, _ = _triton(msa, q2k, iq, ik, dscore, chunk=7)
    assert torch.equal(keys.cpu(), want_keys)
    assert torch.equal(torch.isnan(scores.cpu()), torch.isnan(want_scores))
    assert torch.isnan(want_scores).any()
    assert not torch.isfinite(want_k).all() and torch.isfinite(want_k).any()
    _finite_parts_close(dq.cpu(), want_q, 1e-2)
    _finite_parts_close(dk.cpu(), want_k, 1e-2)


def _same_rows(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit on the GPU, where a row's products do not depend on the tile's other rows.
    Under the interpreter a tile's dot is one numpy matmul, whose blocking (and so its last
    bit) can follow the tile's other rows: there, within a few units in the last place."""
    if torch.device(KERNEL_DEVICE).type == "cuda":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=4e-6, atol=1e-6)


def test_query_subset_rows_are_the_full_launch_rows():
    msa, q2k, iq, ik, dscore = _inputs([[70, 5], [33, 64]], 128, 16, 2, 3, 16, 3)
    full = _triton(msa, q2k, iq, ik, dscore)
    dk_sum = torch.zeros(msa.num_tokens, 16)
    for r in range(3):  # three ranks' query subsets (strided, as load balancing interleaves)
        qs = torch.arange(r, msa.num_tokens, 3)
        dq, dk, keys, scores, _ = _triton(msa, q2k[:, qs], iq[qs], ik, dscore[:, qs], qs)
        assert torch.equal(keys.cpu(), full[2].cpu()[:, qs])
        _same_rows(scores.cpu(), full[3].cpu()[:, qs])
        _same_rows(dq.cpu(), full[0].cpu()[qs])
        want_k = _reference(msa, q2k[:, qs], iq[qs], ik, dscore[:, qs], qs)[1]
        assert rel_err(dk.float().cpu(), want_k) < 1e-2
        dk_sum += dk.float().cpu()
    assert rel_err(dk_sum, full[1].float().cpu()) < 1e-2


@pytest.mark.parametrize("deterministic", [False, True])
def test_loss_gradients_bf16_fused_and_torch(deterministic):
    msa, q2k, iq, ik, _ = _inputs([[40, 1], [16, 57], [80]], 100, 16, 2, 4, 32, 1)
    gen = torch.Generator().manual_seed(2)
    heads, tokens, top_k = q2k.shape
    used = q2k >= 0
    mass = torch.where(used, torch.rand(heads, tokens, top_k, generator=gen), 0.0)
    mass = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    dev = layout_on_kernel_device(msa)
    grads = []
    for fused in (True, False):
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        try:
            if fused:
                assert byproducts_module._fused(mass.to(KERNEL_DEVICE), iq.to(KERNEL_DEVICE),
                                                fused)
            q = iq.to(KERNEL_DEVICE).clone().requires_grad_()
            k = ik.to(KERNEL_DEVICE).clone().requires_grad_()
            loss, _ = sparse_indexer_loss_from_byproducts(
                q, k, *(x.to(KERNEL_DEVICE) for x in (q2k, mass)), dev,
                num_index_heads_total=heads, loss_coeff=1.0, fused=fused)
            loss.backward()
            grads.append((q.grad.float().cpu(), k.grad.float().cpu()))
        finally:
            torch.use_deterministic_algorithms(previous)
    for a, b in zip(*grads, strict=True):
        assert torch.isfinite(a).all() and float(b.norm()) > 0 and rel_err(a, b) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels)")
def test_passes_at_minimax_m3_shape_gpu():
    """Compiled at MiniMax-M3's shape (4 index heads of 128, 128-token blocks, top-16) on a
    packed row of 8192 tokens, against the torch version in float64 on the same GPU."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = document_map_from_lengths([[5000, 300, 2892]], 8192, "cuda")
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=128)
    t = msa.num_tokens
    iq = torch.randn(t, 4, 128, device="cuda", generator=gen).to(torch.bfloat16)
    ik = torch.randn(t, 128, device="cuda", generator=gen).to(torch.bfloat16)
    q2k = select_blocks(iq, ik, msa, top_k=16, backend="triton")
    dscore = torch.randn(4, t, 16, device="cuda", generator=gen)
    scores, keys, plan = block_scores_triton(iq, ik, q2k, msa)
    dq, dk = byproduct_grads_triton(dscore, keys, iq, ik, msa, plan)
    want_scores, want_keys = block_scores_reference(iq.double(), ik.double(), q2k, msa)
    used = want_keys >= 0
    # fp32 sums of bf16 products against float64: a near tie may pick another key.
    assert float((keys == want_keys).float().mean()) > 0.999
    assert rel_err(scores[used].double(), want_scores[used]) < 1e-6
    want_q, want_k = _gather_scatter_grads(dscore, keys, iq.float(), ik.float())
    assert rel_err(dq.float(), want_q) < 1e-2 and rel_err(dk.float(), want_k) < 1e-2
    # No atomics: the compiled passes give the same bits again.
    scores2, keys2, plan2 = block_scores_triton(iq, ik, q2k, msa)
    again = byproduct_grads_triton(dscore, keys2, iq, ik, msa, plan2)
    assert torch.equal(scores2, scores) and torch.equal(keys2, keys)
    assert torch.equal(again[0], dq) and torch.equal(again[1], dk)
