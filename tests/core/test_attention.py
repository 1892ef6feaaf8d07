"""Sparse attention forward and gradients against a float64 dense masked attention."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from packs import packed_batches, random_document_map

from nemo_msa import MSAMicrobatch, select_blocks, sparse_attention
from nemo_msa.testing.oracle import attention_f64


def dense_reference(q, k, v, q2k, ids, block, scale):
    """Float64 attention (nemo_msa.testing.oracle's) over documents read off the document map
    token by token, not through the package's layout."""
    lengths = []
    for r in range(ids.shape[0]):
        prev = 0
        for value in ids[r].tolist():
            if value > 0 and value != prev:
                lengths.append(0)
            if value > 0:
                lengths[-1] += 1
            prev = value
    assert sum(lengths) == int((ids > 0).sum())
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    docs = SimpleNamespace(cu_seqlens=cu)
    return attention_f64(q, k, v, q2k, docs, scale, block)[0]


def relative_error(a, b):
    # The floor keeps exactly-zero references (a one-token document has dq = 0) meaningful.
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-3)).item()


def make_inputs(msa, q_heads, kv_heads, dim, dtype, generator, top_k):
    t = msa.num_tokens
    q = torch.randn(t, q_heads, dim, generator=generator).to(dtype)
    k = torch.randn(t, kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(t, kv_heads, dim, generator=generator).to(dtype)
    iq = torch.randn(t, kv_heads, dim, generator=generator, dtype=torch.float64)
    ik = torch.randn(t, dim, generator=generator, dtype=torch.float64)
    q2k = select_blocks(iq, ik, msa, top_k=top_k, backend="reference")
    return q, k, v, q2k


def reference_op(q, k, v, q2k, msa, scale):
    """The public op on the reference backend (its record reads fp32/fp64 too)."""
    return sparse_attention(q, k, v, q2k, msa, softmax_scale=scale, backend="reference")


@settings(max_examples=20, deadline=None)
@given(packed_batches(max_batch=2, max_seq=400, block_sizes=(16, 32)), st.integers(1, 6),
       st.integers(0, 2**31 - 1))
def test_float64_forward_and_gradients_match_dense_reference_tightly(case, top_k, seed):
    ids, block = case
    msa = MSAMicrobatch.from_document_map(ids, block_size=block)
    g = torch.Generator().manual_seed(seed)
    q, k, v, q2k = make_inputs(msa, 4, 2, 8, torch.float64, g, top_k)
    scale = 1 / math.sqrt(8)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = reference_op(q, k, v, q2k, msa, scale)
    ref = dense_reference(q, k, v, q2k, ids, block, scale)
    assert relative_error(out, ref) < 1e-10
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip("qkv", grads, want, strict=True):
        err = relative_error(a, b)
        assert err < 1e-10, f"d{name} relative error {err:.2e}"


@pytest.mark.parametrize(
    "q_heads, kv_heads, seq, max_doc, top_k",
    [
        (16, 1, 1200, 1200, 4),  # one production GQA group, d128, block 128: truly sparse
        (64, 4, 300, 300, 16),  # the full production head topology on a short batch
    ],
)
def test_bf16_within_contract_tolerance(q_heads, kv_heads, seq, max_doc, top_k):
    g = torch.Generator().manual_seed(seq)
    ids = random_document_map(g, batch=2, seq=seq, max_doc=max_doc)
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=128)
    q, k, v, q2k = make_inputs(msa, q_heads, kv_heads, 128, torch.bfloat16, g, top_k=top_k)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = sparse_attention(q, k, v, q2k, msa)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert not torch.isnan(out).any()
    ref = dense_reference(q, k, v, q2k, ids, 128, 1 / math.sqrt(128))
    err = relative_error(out, ref)
    assert 0 < err < 1e-2, f"forward relative error {err:.2e}"
    dout = torch.randn(out.shape, generator=g).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = dense_reference(qd, kd, vd, q2k, ids, 128, 1 / math.sqrt(128))
    want = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    for name, a, b in zip("qkv", grads, want, strict=True):
        assert a.dtype == torch.bfloat16 and not torch.isnan(a).any()
        err = relative_error(a, b)
        assert err < 1e-2, f"d{name} relative error {err:.2e}"


def test_only_selected_blocks_receive_key_gradients():
    ids = torch.ones(1, 64, dtype=torch.int64)
    msa = MSAMicrobatch.from_document_map(ids, block_size=16)
    g = torch.Generator().manual_seed(5)
    q, k, v, _ = make_inputs(msa, 2, 1, 8, torch.float64, g, top_k=2)
    # Every query picks only block 0 (and its own block via -1 padding: none).
    q2k = torch.full((1, 64, 2), -1, dtype=torch.int32)
    q2k[0, :, 0] = 0
    for x in (k, v):
        x.requires_grad_(True)
    out = reference_op(q, k, v, q2k, msa, 0.5)
    dk, dv = torch.autograd.grad(out.sum(), (k, v))
    assert dk[16:].abs().max() == 0 and dv[16:].abs().max() == 0
    assert dk[:16].abs().max() > 0 and dv[:16].abs().max() > 0


def test_deterministic_mode_is_supported_and_bitwise_repeatable():
    g = torch.Generator().manual_seed(7)
    ids = random_document_map(g, batch=1, seq=300, max_doc=200)
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=32)
    q, k, v, q2k = make_inputs(msa, 8, 2, 16, torch.bfloat16, g, top_k=3)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = []
        for _ in range(2):
            qs, ks, vs = (x.clone().requires_grad_(True) for x in (q, k, v))
            out = sparse_attention(qs, ks, vs, q2k, msa)
            results.append((out, *torch.autograd.grad(out.float().square().sum(), (qs, ks, vs))))
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"k": torch.zeros(5, 2, 8)}, "q, k, v dtypes differ"),
        ({"v": torch.zeros(5, 2, 8, dtype=torch.float16)}, "q, k, v dtypes differ"),
        ({"q": torch.zeros(5, 3, 8, dtype=torch.bfloat16)}, r"query heads \(3\)"),
        (
            {"k": torch.zeros(4, 2, 8, dtype=torch.bfloat16),
             "v": torch.zeros(4, 2, 8, dtype=torch.bfloat16)},
            "disagree on tokens",
        ),
        ({"v": torch.zeros(5, 2, 4, dtype=torch.bfloat16)}, r"k \(5, 2, 8\) and v \(5, 2, 4\)"),
        ({"q2k": torch.zeros(2, 5, 4, dtype=torch.int64)}, "q2k must be int32"),
        ({"q2k": torch.zeros(1, 5, 4, dtype=torch.int32)}, r"kv_heads=2, tokens=5"),
    ],
)
def test_bad_attention_inputs_raise_value_error_naming_them(change, message):
    msa = MSAMicrobatch.build(batch_size=1, seq_len=5, block_size=16)
    args = {
        "q": torch.zeros(5, 4, 8, dtype=torch.bfloat16),
        "k": torch.zeros(5, 2, 8, dtype=torch.bfloat16),
        "v": torch.zeros(5, 2, 8, dtype=torch.bfloat16),
        "q2k": torch.zeros(2, 5, 4, dtype=torch.int32),
    }
    args.update(change)
    with pytest.raises(ValueError, match=message):
        sparse_attention(args["q"], args["k"], args["v"], args["q2k"], msa)
