"""The sparse indexer loss from the forward's block mass (the selected blocks' scores and argmax
keys from one pass over them).

Reference side: ``compute_indexer_loss(..., sparse=True)``, which gathers the selected keys
again and recomputes both distributions per query chunk. Both run here in float64 on the CPU,
so values and gradients must agree to 1e-6 (MSA_SPEC: "Sparse form").
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from packs import packed_batches

from nemo_msa import MSAMicrobatch, select_blocks, sparse_attention
from nemo_msa.attention.naive import sparse_attention_forward_reference
from nemo_msa.indexer_loss import (
    compute_indexer_loss,
    sampled_selection_recall,
    sparse_indexer_loss_from_byproducts,
)
from nemo_msa.indexer_loss.byproducts import block_scores_reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _inputs(msa, heads, group, dim, generator, dtype=torch.float64):
    t = msa.num_tokens
    return (
        torch.randn(t, heads, dim, dtype=dtype, generator=generator),  # index_q
        torch.randn(t, dim, dtype=dtype, generator=generator),  # index_k
        torch.randn(t, heads * group, dim, dtype=dtype, generator=generator),  # query
        torch.randn(t, heads, dim, dtype=dtype, generator=generator),  # key
        torch.randn(t, heads, dim, dtype=dtype, generator=generator),  # value
    )


def _both_losses(msa, index_q, index_k, query, key, value, top_k, scale):
    q2k = select_blocks(index_q, index_k, msa, top_k=top_k)
    _, _, mass = sparse_attention_forward_reference(query, key, value, q2k, msa, scale,
                                                    return_block_mass=True)
    iq = index_q.clone().requires_grad_(True)
    ik = index_k.clone().requires_grad_(True)
    fused, stats = sparse_indexer_loss_from_byproducts(
        iq, ik, q2k, mass, msa, num_index_heads_total=index_q.shape[1], loss_coeff=0.7)
    fused.backward()
    rq = index_q.clone().requires_grad_(True)
    rk = index_k.clone().requires_grad_(True)
    ref, ref_stats = compute_indexer_loss(
        rq, rk, query, key, msa, softmax_scale=scale, num_index_heads_total=index_q.shape[1],
        loss_coeff=0.7, q2k=q2k, sparse=True)
    ref.backward()
    return (fused, stats, iq.grad, ik.grad), (ref, ref_stats, rq.grad, rk.grad), q2k


@settings(max_examples=25, deadline=None)
@given(pack=packed_batches(max_batch=2, max_seq=300, block_sizes=(16, 32)),
       top_k=st.integers(1, 6), init=st.integers(0, 1), local=st.integers(0, 1),
       seed=st.integers(0, 2**16))
def test_byproduct_loss_equals_the_recomputing_reference(pack, top_k, init, local, seed):
    ids, block = pack
    if init + local > top_k:
        init = 0
    msa = MSAMicrobatch.from_document_map(ids, block_size=block, init_blocks=init,
                                          local_blocks=local)
    generator = torch.Generator().manual_seed(seed)
    inputs = _inputs(msa, heads=2, group=2, dim=8, generator=generator)
    (fused, stats, gq, gk), (ref, ref_stats, rq, rk), _ = _both_losses(
        msa, *inputs, top_k=top_k, scale=0.3)
    fused, ref = float(fused.detach()), float(ref.detach())
    assert abs(fused - ref) <= 1e-9 + 1e-6 * abs(ref), (fused, ref)
    assert float(stats["kl"]) == pytest.approx(float(ref_stats["kl"]), rel=1e-6, abs=1e-12)
    if float(rq.norm()) > 0:
        assert _rel(gq, rq) < 1e-6, _rel(gq, rq)
        assert _rel(gk, rk) < 1e-6, _rel(gk, rk)
    else:  # every query sees one block: KL 0 and no gradient in both
        assert float(gq.norm()) == 0.0 and float(gk.norm()) == 0.0


def test_byproducts_hold_forced_blocks_real_scores_and_minus_one_tails():
    """Forced blocks rank first in the selection but carry their real score; slots past the
    document's block count are -1 with score -inf, key -1 and mass 0; a slot's key is a
    visible key of its block attaining the score."""
    ids = torch.tensor([[1] * 70 + [2] * 9 + [0] * 17])
    msa = MSAMicrobatch.from_document_map(ids, block_size=16, init_blocks=1, local_blocks=1)
    generator = torch.Generator().manual_seed(3)
    index_q, index_k, query, key, value = _inputs(msa, 2, 2, 8, generator)
    q2k = select_blocks(index_q, index_k, msa, top_k=4)
    scores, keys = block_scores_reference(index_q, index_k, q2k, msa)
    _, _, mass = sparse_attention_forward_reference(query, key, value, q2k, msa, 0.3,
                                                    return_block_mass=True)
    docs = msa.token_documents.long()
    pos = msa.document_positions.long()
    for h in range(2):
        for t in range(msa.num_tokens):
            for s in range(4):
                b = int(q2k[h, t, s])
                if b < 0:
                    assert scores[h, t, s] == -math.inf and keys[h, t, s] == -1
                    assert mass[h, t, s] == 0
                    continue
                start = t - int(pos[t])
                visible = [start + j for j in range(b * 16, min(b * 16 + 16, int(pos[t]) + 1))]
                dots = index_k[visible] @ index_q[t, h]
                assert float(scores[h, t, s]) == pytest.approx(float(dots.max()), rel=1e-12)
                assert int(keys[h, t, s]) == visible[int(dots.argmax())]
                assert int(docs[int(keys[h, t, s])]) == int(docs[t])
    # The mass of a token's selected blocks sums to 1 (its softmax over the selected keys).
    used = (q2k >= 0).any(-1)
    assert torch.allclose(mass.sum(-1)[used], torch.ones(()).double(), atol=1e-12)
    # Both forced kinds present: block 0 and the own block in every row past the first block.
    own = (pos // 16)
    assert bool(((q2k == 0).any(-1)).all()) and bool((q2k == own[None, :, None]).any(-1).all())


def test_block_mass_equals_the_masked_dense_softmax():
    ids = torch.tensor([[1] * 50 + [2] * 40 + [0] * 6, [3] * 96])
    msa = MSAMicrobatch.from_document_map(ids, block_size=16)
    generator = torch.Generator().manual_seed(5)
    _, _, query, key, value = _inputs(msa, 2, 4, 8, generator)
    # Distinct blocks in 0..5 (some past the own block), ascending, the last slot -1 at times.
    q2k = torch.sort(torch.rand(2, msa.num_tokens, 6, generator=generator).argsort(-1)[..., :3],
                     dim=-1).values
    tail = torch.rand(2, msa.num_tokens, generator=generator) < 0.3
    q2k[..., 2] = torch.where(tail, -1, q2k[..., 2])
    q2k = q2k.int()
    _, _, mass = sparse_attention_forward_reference(query, key, value, q2k, msa, 0.25,
                                                    return_block_mass=True)
    docs, pos = msa.token_documents.long(), msa.document_positions.long()
    for t in range(0, msa.num_tokens, 7):
        for g in range(2):
            keys = [j for j in range(msa.num_tokens) if docs[j] == docs[t] and pos[j] <= pos[t]
                    and int(pos[j]) // 16 in q2k[g, t].tolist()]
            if not keys:
                continue
            s = (query[t, g * 4:(g + 1) * 4] @ key[keys, g].T) * 0.25  # [4, n]
            p = torch.softmax(s, -1)
            for slot, b in enumerate(q2k[g, t].tolist()):
                inside = [i for i, j in enumerate(keys) if b >= 0 and int(pos[j]) // 16 == b]
                want = float(p[:, inside].sum(-1).mean()) if inside else 0.0
                assert float(mass[g, t, slot]) == pytest.approx(want, abs=1e-12)


def test_sparse_attention_returns_the_reference_block_mass_in_bf16():
    ids = torch.tensor([[1] * 40 + [2] * 24])
    msa = MSAMicrobatch.from_document_map(ids, block_size=16)
    generator = torch.Generator().manual_seed(9)
    index_q, index_k, query, key, value = (x.bfloat16() for x in _inputs(msa, 2, 2, 16,
                                                                          generator))
    q2k = select_blocks(index_q, index_k, msa, top_k=2)
    out, mass = sparse_attention(query, key, value, q2k, msa, return_block_mass=True,
                                 backend="reference")
    _, _, want = sparse_attention_forward_reference(query.double(), key.double(),
                                                    value.double(), q2k, msa, 16 ** -0.5,
                                                    return_block_mass=True)
    assert mass.dtype == torch.float32 and mass.shape == (2, msa.num_tokens, 2)
    assert _rel(mass.double(), want) < 1e-2
    assert not mass.requires_grad and out.requires_grad is False


def test_nan_index_scores_make_both_losses_nan():
    ids = torch.tensor([[1] * 48])
    msa = MSAMicrobatch.from_document_map(ids, block_size=16)
    generator = torch.Generator().manual_seed(1)
    index_q, index_k, query, key, value = _inputs(msa, 2, 2, 8, generator)
    index_k[5] = float("nan")  # a key of block 0: every later query scores block 0 NaN
    (fused, _, _, _), (ref, _, _, _), _ = _both_losses(msa, index_q, index_k, query, key, value,
                                                       top_k=2, scale=0.3)
    assert math.isnan(float(fused.detach())) and math.isnan(float(ref.detach()))


def test_byproduct_shapes_are_checked():
    index_q = torch.randn(10, 2, 8)
    index_k = torch.randn(10, 8)
    good = torch.zeros(2, 10, 3)
    msa = MSAMicrobatch.from_document_map(torch.ones(1, 10, dtype=torch.long), block_size=16)
    with pytest.raises(ValueError, match=r"q2k has shape \(2, 9, 3\)"):
        sparse_indexer_loss_from_byproducts(index_q, index_k, torch.zeros(2, 9, 3).int(), good,
                                            msa, num_index_heads_total=2, loss_coeff=1.0)
    with pytest.raises(ValueError, match="must have one shape"):
        sparse_indexer_loss_from_byproducts(index_q, index_k, good.int(), torch.zeros(2, 10, 4),
                                            msa, num_index_heads_total=2, loss_coeff=1.0)
    with pytest.raises(ValueError, match="q2k must be int32 block ids, got torch.int64"):
        sparse_indexer_loss_from_byproducts(index_q, index_k, good.long(), good, msa,
                                            num_index_heads_total=2, loss_coeff=1.0)
    other = MSAMicrobatch.from_document_map(torch.ones(1, 12, dtype=torch.long), block_size=16)
    with pytest.raises(ValueError, match="num_tokens=12"):
        sparse_indexer_loss_from_byproducts(index_q, index_k, good.int(), good, other,
                                            num_index_heads_total=2, loss_coeff=1.0)


def test_sampled_recall_is_exact_on_every_row_and_a_mean_on_a_sample():
    ids = torch.tensor([[1] * 60 + [2] * 30 + [0] * 6, [3] * 96])
    msa = MSAMicrobatch.from_document_map(ids, block_size=16)
    generator = torch.Generator().manual_seed(2)
    index_q, index_k, query, key, _ = _inputs(msa, 2, 2, 8, generator)
    q2k = select_blocks(index_q, index_k, msa, top_k=2)
    _, exact = compute_indexer_loss(index_q, index_k, query, key, msa, softmax_scale=0.3,
                                    num_index_heads_total=2, loss_coeff=1.0, q2k=q2k)
    full = sampled_selection_recall(query, key, q2k, msa, softmax_scale=0.3, num_rows=10_000)
    assert float(full["recall_count"]) == float(exact["recall_count"])
    assert float(full["recall_mass"]) == pytest.approx(float(exact["recall_mass"]), rel=1e-10)
    # A sample of 7 rows: the covered mass of exactly those rows, from per-row exact values.
    sample = sampled_selection_recall(query, key, q2k, msa, softmax_scale=0.3, num_rows=7)
    rows = ((torch.arange(7, dtype=torch.float64) + 0.5) * msa.num_tokens / 7).long()
    per_row = []
    for t in rows.tolist():
        one = MSAMicrobatch.from_document_map(ids, block_size=16)
        _, st_ = compute_indexer_loss(index_q, index_k, query, key, one, softmax_scale=0.3,
                                      num_index_heads_total=2, loss_coeff=1.0,
                                      q2k=torch.where(torch.arange(msa.num_tokens)[None, :,
                                                                                   None] == t,
                                                      q2k, -1).int())
        per_row.append(float(st_["recall_mass"]))
    assert float(sample["recall_count"]) == 14.0
    assert float(sample["recall_mass"]) == pytest.approx(sum(per_row), rel=1e-10)
    with pytest.raises(ValueError, match="num_rows=0"):
        sampled_selection_recall(query, key, q2k, msa, softmax_scale=0.3, num_rows=0)
