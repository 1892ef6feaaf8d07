"""The flashinfer adapter's conversions, end to end against a CPU double of flashinfer.

``flashinfer_double.msa_sparse_attention`` stands in for ``flashinfer.msa_ops``'s entry (it
checks every documented precondition and computes the documented semantics with the project's
reference); it is installed by monkeypatching the adapter's import point,
``flashinfer_adapter.load_msa_sparse_attention``. The double itself is checked against the dense
oracle and shown to refuse each precondition violation.
"""

from __future__ import annotations

import math

import flashinfer_double
import pytest
import torch
from flashinfer_double import FlashinferContractError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packs import document_map_from_rows, packed_batches

from nemo_msa import MSAMicrobatch
from nemo_msa.attention import flashinfer_adapter as fa
from nemo_msa.attention.naive import (
    document_causal_mask,
    masked_attention_reference,
    selected_key_mask,
    sparse_attention_forward_reference,
)
from nemo_msa.selection.naive import select_blocks_reference


def _inputs(msa, hq, hkv, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = msa.num_tokens
    q = torch.randn(t, hq, d, generator=g).bfloat16()
    k = torch.randn(t, hkv, d, generator=g).bfloat16()
    v = torch.randn(t, hkv, d, generator=g).bfloat16()
    return q, k, v, g


def _selected(msa, hkv, top_k, g):
    """Canonical q2k from the reference selection (int32 [Hkv, T, top_k])."""
    t = msa.num_tokens
    return select_blocks_reference(torch.randn(t, hkv, 16, generator=g),
                                   torch.randn(t, 16, generator=g), msa, top_k=top_k,
                                   init_blocks=0, local_blocks=1)


def _scrambled(msa, hkv, top_k, g):
    """Non-canonical q2k: any order, repeats, -1 anywhere, negative and future ids."""
    most = -(-msa.max_seqlen // msa.block_size) + 2
    return torch.randint(-3, most, (hkv, msa.num_tokens, top_k), generator=g,
                         dtype=torch.int32)


def _canonical_rows_oracle(q2k, msa):
    """Python-loop oracle of to_flashinfer_q2k: per row, sorted set of ids in 0..own block."""
    own = (msa.document_positions.long() // msa.block_size).tolist()
    out = torch.full((q2k.shape[0], q2k.shape[1], 16), -1, dtype=torch.int32)
    for h in range(q2k.shape[0]):
        for t in range(q2k.shape[1]):
            ids = sorted({x for x in q2k[h, t].tolist() if 0 <= x <= own[t]})
            out[h, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


def _production_like_layout():
    # Rows with padding; documents shorter than a block, exactly one block, and several blocks.
    rows = [[(300, 5), (1, 0), (128, 3)], [(70, 0), (420, 0)]]
    return MSAMicrobatch.from_document_map(document_map_from_rows(rows, 520), block_size=128)


# ------------------------------------------------------------------ the double itself


def test_double_matches_the_dense_oracle():
    """The double's numbers (from the sparse reference) equal dense masked attention, an
    independent path, with the LSE written as the docstring says: fp32 [total_q, Hq]."""
    msa = _production_like_layout()
    q, k, v, g = _inputs(msa, 4, 2)
    q2k = fa.to_flashinfer_q2k(_selected(msa, 2, 3, g), msa)
    cu = msa.cu_seqlens
    scale = 0.1
    out, lse = flashinfer_double.msa_sparse_attention(
        q, k, v, q2k, cu, cu, causal=True, softmax_scale=scale, return_softmax_lse=True)
    ref = masked_attention_reference(q, k, v, msa, scale, q2k=q2k)
    torch.testing.assert_close(out, ref)
    ref_lse = _dense_lse(q, k, msa, q2k, scale)  # [Hq, T]
    assert lse.dtype == torch.float32 and lse.shape == (msa.num_tokens, 4)
    torch.testing.assert_close(lse, ref_lse.t(), rtol=1e-5, atol=1e-5)


def _valid_call():
    msa = _production_like_layout()
    q, k, v, g = _inputs(msa, 4, 2)
    q2k = fa.to_flashinfer_q2k(_selected(msa, 2, 3, g), msa)
    return msa, dict(q=q, k=k, v=v, q2k_indices=q2k, cu_seqlens_q=msa.cu_seqlens.clone(),
                     cu_seqlens_k=msa.cu_seqlens.clone(), causal=True, return_softmax_lse=True)


def _swap_first_two(q2k):
    q2k = q2k.clone()
    row = q2k[0, 200]  # a token 200 deep in a 300-token document: 2 selected blocks
    assert row[1] >= 0
    row[[0, 1]] = row[[1, 0]]
    return q2k


def _set(q2k, index, value):
    q2k = q2k.clone()
    q2k[index] = value
    return q2k


_VIOLATIONS = {
    "q fp32": lambda c: {"q": c["q"].float()},
    "q head dim 64": lambda c: {"q": c["q"][..., :64].contiguous(),
                                "k": c["k"][..., :64].contiguous(),
                                "v": c["v"][..., :64].contiguous()},
    "q not contiguous": lambda c: {"q": c["q"].transpose(0, 1).contiguous().transpose(0, 1)},
    "k fp16": lambda c: {"k": c["k"].half()},
    "k not contiguous": lambda c: {"k": c["k"].transpose(0, 1).contiguous().transpose(0, 1)},
    "v shape": lambda c: {"v": c["v"][:-1].contiguous()},
    "group 32": lambda c: {"q": c["q"].repeat_interleave(16, dim=1),
                           "k": c["k"][:, :1].contiguous(), "v": c["v"][:, :1].contiguous(),
                           "q2k_indices": c["q2k_indices"][:1].contiguous()},
    "q2k int64": lambda c: {"q2k_indices": c["q2k_indices"].long()},
    "q2k topk 8": lambda c: {"q2k_indices": c["q2k_indices"][..., :8].contiguous()},
    "q2k heads": lambda c: {"q2k_indices": c["q2k_indices"][:1].contiguous()},
    "q2k not contiguous": lambda c: {
        "q2k_indices": c["q2k_indices"].transpose(0, 1).contiguous().transpose(0, 1)},
    "q2k unsorted": lambda c: {"q2k_indices": _swap_first_two(c["q2k_indices"])},
    "q2k repeated id": lambda c: {"q2k_indices": _set(c["q2k_indices"], (0, 200, 1), 0)},
    "q2k -1 before an id": lambda c: {"q2k_indices": _set(c["q2k_indices"], (0, 200, 0), -1)},
    "q2k -2": lambda c: {"q2k_indices": _set(c["q2k_indices"], (0, 5, 15), -2)},
    "q2k id past the sequence": lambda c: {"q2k_indices": _set(c["q2k_indices"], (0, 5, 1), 3)},
    "cu_seqlens int64": lambda c: {"cu_seqlens_q": c["cu_seqlens_q"].long()},
    "cu_seqlens_k int64": lambda c: {"cu_seqlens_k": c["cu_seqlens_k"].long()},
    "cu_seqlens not from 0": lambda c: {"cu_seqlens_q": c["cu_seqlens_q"] + 1},
    "cu_seqlens wrong total": lambda c: {"cu_seqlens_q": _set(c["cu_seqlens_q"], -1, 5)},
    "cu_seqlens decreasing": lambda c: {"cu_seqlens_q": _set(c["cu_seqlens_q"], 1, 302)},
    "cu_seqlens 2-D": lambda c: {"cu_seqlens_q": c["cu_seqlens_q"][None]},
    "no cu_seqlens_k": lambda c: {"cu_seqlens_k": None},
    "cu_seqlens_k length": lambda c: {"cu_seqlens_k": torch.tensor([0, 919], dtype=torch.int32)},
    "scale not finite": lambda c: {"softmax_scale": math.inf},
}


def test_the_double_accepts_the_valid_call():
    msa, call = _valid_call()
    assert msa.num_tokens == 919 and msa.cu_seqlens.tolist() == [0, 300, 301, 429, 499, 919]
    out, lse = flashinfer_double.msa_sparse_attention(**call)
    assert out.shape == call["q"].shape and lse.shape == (919, 4)


@pytest.mark.parametrize("name", sorted(_VIOLATIONS))
def test_the_double_refuses_each_precondition_violation(name):
    _, call = _valid_call()
    call.update(_VIOLATIONS[name](call))
    with pytest.raises(FlashinferContractError):
        flashinfer_double.msa_sparse_attention(**call)


@pytest.mark.parametrize("change", [{"causal": False}, {"q_offset": 0}, {"page_table": 1},
                                    {"return_temperature_lse": True}])
def test_the_double_refuses_what_it_does_not_model(change):
    _, call = _valid_call()
    call.update(change)
    with pytest.raises(NotImplementedError):
        flashinfer_double.msa_sparse_attention(**call)


# ------------------------------------------------------------------ conversions


def test_canonical_q2k_is_only_widened():
    msa = _production_like_layout()
    _, _, _, g = _inputs(msa, 2, 2)
    q2k = _selected(msa, 2, 5, g)
    got = fa.to_flashinfer_q2k(q2k, msa)
    assert got.dtype == torch.int32 and got.shape == (2, msa.num_tokens, 16)
    assert got.is_contiguous()
    assert torch.equal(got[..., :5], q2k) and bool((got[..., 5:] == -1).all())


@pytest.mark.parametrize("top_k", [1, 7, 16])
def test_any_q2k_becomes_its_set_of_counting_ids(top_k):
    msa = _production_like_layout()
    g = torch.Generator().manual_seed(top_k)
    q2k = _scrambled(msa, 2, top_k, g)
    got = fa.to_flashinfer_q2k(q2k, msa)
    assert torch.equal(got, _canonical_rows_oracle(q2k, msa))
    assert fa.to_flashinfer_q2k(got, msa).equal(got)  # idempotent


def test_q2k_conversion_refuses_what_flashinfer_cannot_take():
    msa = _production_like_layout()
    with pytest.raises(ValueError, match="top_k=17"):
        fa.to_flashinfer_q2k(torch.zeros(1, msa.num_tokens, 17, dtype=torch.int32), msa)
    with pytest.raises(ValueError, match="int32"):
        fa.to_flashinfer_q2k(torch.zeros(1, msa.num_tokens, 4, dtype=torch.int64), msa)
    with pytest.raises(ValueError, match="T=919"):
        fa.to_flashinfer_q2k(torch.zeros(1, 5, 4, dtype=torch.int32), msa)


def test_cu_seqlens_are_the_documents():
    msa = _production_like_layout()
    cu = fa.flashinfer_cu_seqlens(msa)
    assert cu.dtype == torch.int32 and cu.is_contiguous()
    assert cu.tolist() == [0, 300, 301, 429, 499, 919]  # padding is not a sequence


def test_lse_is_transposed_to_heads_by_tokens():
    lse = torch.randn(7, 3)
    lse[2, 1] = -math.inf
    got = fa.from_flashinfer_lse(lse, num_heads=3, num_tokens=7)
    assert got.shape == (3, 7) and got.is_contiguous() and torch.equal(got, lse.t())
    with pytest.raises(ValueError, match="fp32"):
        fa.from_flashinfer_lse(lse.t(), num_heads=3, num_tokens=7)
    with pytest.raises(ValueError, match="fp32"):
        fa.from_flashinfer_lse(lse.double(), num_heads=3, num_tokens=7)


@pytest.mark.parametrize("block, hq, hkv, d, top_k, dtype, match", [
    (64, 4, 2, 128, 4, torch.bfloat16, "msa_block_size=64"),
    (128, 4, 2, 64, 4, torch.bfloat16, "kv_channels=64"),
    (128, 4, 2, 128, 17, torch.bfloat16, "msa_topk=17"),
    (128, 32, 1, 128, 4, torch.bfloat16, "= 32 query heads per KV head"),
    (128, 4, 2, 128, 4, torch.float32, "torch.float32"),
    (128, 64, 4, 128, 16, torch.bfloat16, None),  # MiniMax-M3
    (128, 4, 4, 128, 1, torch.float16, None),
])
def test_unsupported_shape_reason(block, hq, hkv, d, top_k, dtype, match):
    msa = MSAMicrobatch.from_document_map(torch.ones(1, 10, dtype=torch.int64),
                                          block_size=block)
    q = torch.zeros(10, hq, d, dtype=dtype)
    k = torch.zeros(10, hkv, d, dtype=dtype)
    q2k = torch.zeros(hkv, 10, top_k, dtype=torch.int32)
    reason = fa.unsupported_shape_reason(q, k, q2k, msa)
    if match is None:
        assert reason is None
    else:
        assert match in reason


# ------------------------------------------------------------------ end to end


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pack=packed_batches(max_batch=3, max_seq=400, block_sizes=(128,)),
       heads=st.sampled_from([(1, 1), (4, 2), (16, 1), (6, 3)]),
       top_k=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_forward_and_lse_equal_the_reference(fake_flashinfer, pack, heads, top_k, seed):
    """Random packs (documents of 1 token, shorter than a block, whole blocks; padding between
    and after them) and the selection's canonical q2k: the adapter's forward through the double
    equals the reference backend's forward, output and LSE."""
    document_map, block = pack
    msa = MSAMicrobatch.from_document_map(document_map, block_size=block)
    hq, hkv = heads
    q, k, v, g = _inputs(msa, hq, hkv, seed=seed)
    q2k = _selected(msa, hkv, top_k, g)
    scale = 1.0 / math.sqrt(128)
    fake_flashinfer.clear()
    out, lse = fa.flashinfer_attention_forward(q, k, v, q2k, msa, scale)
    ref_out, ref_lse = sparse_attention_forward_reference(q, k, v, q2k, msa, scale)
    assert len(fake_flashinfer) == 1
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (hq, msa.num_tokens)
    torch.testing.assert_close(out, ref_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def _dense_lse(q, k, msa, q2k, scale):
    """fp32 [Hq, T] log-sum-exp over the keys a (any) q2k makes visible, -inf for none."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    visible = document_causal_mask(msa)[None] & selected_key_mask(msa, q2k)  # [Hkv, T, T]
    scores = torch.einsum("tgqd,sgd->gqts", q.float().view(t, hkv, hq // hkv, d), k.float())
    scores = (scores * scale).masked_fill(~visible[:, None], -math.inf)
    return torch.logsumexp(scores, dim=-1).reshape(hq, t)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pack=packed_batches(max_batch=3, max_seq=400, block_sizes=(128,)),
       heads=st.sampled_from([(1, 1), (4, 2), (16, 1), (6, 3)]),
       top_k=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_any_q2k_gives_the_dense_oracle(fake_flashinfer, pack, heads, top_k, seed):
    """Non-canonical q2k (any order, repeated ids, -1 anywhere, ids below -1, past the own
    block or past the document) mean the set of ids in 0..own block (MSA_SPEC.md): the forward
    equals dense masked attention over exactly those blocks. (The oracle is the dense path:
    the chunked reference counts a repeated id twice and indexes past the workspace for ids
    past the last document's end.)"""
    document_map, block = pack
    msa = MSAMicrobatch.from_document_map(document_map, block_size=block)
    hq, hkv = heads
    q, k, v, g = _inputs(msa, hq, hkv, seed=seed)
    q2k = _scrambled(msa, hkv, top_k, g)
    scale = 1.0 / math.sqrt(128)
    out, lse = fa.flashinfer_attention_forward(q, k, v, q2k, msa, scale)
    torch.testing.assert_close(out, masked_attention_reference(q, k, v, msa, scale, q2k=q2k))
    ref_lse = _dense_lse(q, k, msa, q2k, scale)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_the_call_flashinfer_receives(fake_flashinfer):
    """One sequence per document, the layout's cu_seqlens as both q and k offsets, causal,
    the scale and the LSE request passed through, a 16-column canonical q2k."""
    msa = _production_like_layout()
    q, k, v, g = _inputs(msa, 4, 2)
    q2k = _selected(msa, 2, 2, g)
    fa.flashinfer_attention_forward(q, k, v, q2k, msa, 0.25)
    (args, kwargs), = fake_flashinfer
    assert args[0] is q and args[1] is k and args[2] is v
    assert torch.equal(args[3], fa.to_flashinfer_q2k(q2k, msa))
    assert args[4] is args[5] and torch.equal(args[4], msa.cu_seqlens)
    assert kwargs == {"causal": True, "softmax_scale": 0.25, "return_softmax_lse": True}


def test_rows_that_select_nothing_give_zeros_and_minus_infinity(fake_flashinfer):
    msa = _production_like_layout()
    q, k, v, g = _inputs(msa, 4, 2)
    q2k = _selected(msa, 2, 2, g)
    q2k[1, 10:20] = -1           # nothing selected
    q2k[0, 30:40] = 2            # only a block past the own block (position < 128)
    out, lse = fa.flashinfer_attention_forward(q, k, v, q2k, msa, 0.1)
    assert bool((out[10:20, 2:] == 0).all()) and bool((out[30:40, :2] == 0).all())
    assert bool(torch.isneginf(lse[2:, 10:20]).all()) and bool(torch.isneginf(lse[:2, 30:40]).all())
    assert bool(torch.isfinite(lse[:, :10]).all())


@pytest.mark.parametrize("block, d, top_k", [(64, 128, 4), (128, 64, 4), (128, 128, 17)])
def test_forward_refuses_shapes_the_kernel_does_not_take(fake_flashinfer, block, d, top_k):
    document_map = torch.ones(1, 200, dtype=torch.int64)
    msa = MSAMicrobatch.from_document_map(document_map, block_size=block)
    q, k, v, _ = _inputs(msa, 2, 1, d=d)
    q2k = torch.zeros(1, 200, top_k, dtype=torch.int32)
    with pytest.raises(ValueError, match="flashinfer backend"):
        fa.flashinfer_attention_forward(q, k, v, q2k, msa, 0.1)
    assert fake_flashinfer == []
