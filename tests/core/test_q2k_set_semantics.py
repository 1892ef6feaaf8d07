"""q2k means a set (MSA_SPEC.md): order, duplicates, -1 and out-of-range ids change nothing.

The reference backend is checked on hypothesis-generated non-canonical q2k (shuffled, with
duplicates, -1 anywhere, ids past the own block, negative ids and ids past the workspace)
against the canonical q2k: the float64 forward against an independent dense oracle, and the bf16
op's output and gradients against the canonical call. ``validate=True`` names the first bad
(head, token, slot).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_msa import MSAMicrobatch, select, select_blocks, sparse_attention
from nemo_msa.attention.naive import (
    canonical_q2k,
    masked_attention_reference,
    sparse_attention_forward_reference,
)
from nemo_msa.ops import validate_q2k

BLOCK = 16
TOP_K = 4
KV_HEADS, Q_HEADS, DIM = 2, 4, 16


def _layout() -> MSAMicrobatch:
    ids = torch.tensor([[1] * 70 + [2] * 50 + [0] * 8, [3] * 128])
    return MSAMicrobatch.build(packed_seq_ids=ids, block_size=BLOCK)


def _canonical(msa: MSAMicrobatch, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    index_q = torch.randn(msa.num_tokens, KV_HEADS, DIM, generator=gen)
    index_k = torch.randn(msa.num_tokens, DIM, generator=gen)
    return select_blocks(index_q, index_k, msa, top_k=TOP_K, backend="reference")


def _scramble(q2k: torch.Tensor, msa: MSAMicrobatch, seed: int, extra: int) -> torch.Tensor:
    """The same sets written non-canonically, ``extra`` slots wider."""
    rng = np.random.default_rng(seed)
    own = (msa.document_positions // BLOCK).tolist()
    heads, tokens, _ = q2k.shape
    out = np.empty((heads, tokens, TOP_K + extra), dtype=np.int64)
    for h in range(heads):
        for t in range(tokens):
            kept = [b for b in q2k[h, t].tolist() if b >= 0]
            junk_pool = [-1, -7, own[t] + 1, own[t] + 3, 10**6, *kept]  # kept ids: duplicates
            row = kept + [int(rng.choice(junk_pool)) for _ in range(TOP_K + extra - len(kept))]
            out[h, t] = rng.permutation(row)
    return torch.from_numpy(out).to(torch.int32)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), extra=st.integers(0, 4))
def test_reference_forward_means_the_set(seed, extra):
    msa = _layout()
    canon = _canonical(msa, seed)
    messy = _scramble(canon, msa, seed, extra)
    assert torch.equal(canonical_q2k(messy, msa)[..., :TOP_K], canon)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(msa.num_tokens, Q_HEADS, DIM, dtype=torch.float64, generator=gen)
    k = torch.randn(msa.num_tokens, KV_HEADS, DIM, dtype=torch.float64, generator=gen)
    v = torch.randn(msa.num_tokens, KV_HEADS, DIM, dtype=torch.float64, generator=gen)
    scale = 1 / math.sqrt(DIM)
    out, _ = sparse_attention_forward_reference(q, k, v, messy, msa, scale)
    want = masked_attention_reference(q, k, v, msa, scale, q2k=canon)  # independent oracle
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), extra=st.integers(0, 4))
def test_reference_op_and_gradients_mean_the_set(seed, extra):
    msa = _layout()
    canon = _canonical(msa, seed)
    messy = _scramble(canon, msa, seed, extra)
    gen = torch.Generator().manual_seed(seed + 2)
    base = [torch.randn(msa.num_tokens, h, DIM, generator=gen).to(torch.bfloat16)
            for h in (Q_HEADS, KV_HEADS, KV_HEADS)]
    results = []
    for q2k in (canon, messy):
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = sparse_attention(q, k, v, q2k, msa, backend="reference")
        out.float().square().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)


def test_the_dense_oracle_reads_the_set_too():
    msa = _layout()
    canon = _canonical(msa, 5)
    messy = _scramble(canon, msa, 5, 3)
    q = torch.randn(msa.num_tokens, Q_HEADS, DIM, dtype=torch.float64)
    k = torch.randn(msa.num_tokens, KV_HEADS, DIM, dtype=torch.float64)
    v = torch.randn(msa.num_tokens, KV_HEADS, DIM, dtype=torch.float64)
    torch.testing.assert_close(masked_attention_reference(q, k, v, msa, q2k=messy),
                               masked_attention_reference(q, k, v, msa, q2k=canon))


def _edit(q2k: torch.Tensor, h: int, t: int, row: list[int]) -> torch.Tensor:
    out = q2k.clone()
    out[h, t] = torch.tensor(row, dtype=torch.int32)
    return out


def test_validate_accepts_canonical_and_names_the_first_bad_slot():
    msa = _layout()
    canon = _canonical(msa, 1)
    validate_q2k(canon, msa)
    t = 100  # document 2, position 30: own block 1
    assert int(msa.document_positions[t]) // BLOCK == 1
    cases = [
        ([1, 0, -1, -1], r"q2k\[1, 100, 1\] = 0 \(head 1, token 100, slot 1\) is not above slot "
                         r"0 \(1\): ids must ascend"),
        ([0, 0, 1, -1], r"q2k\[1, 100, 1\] = 0 .* is a duplicate of slot 0"),
        ([-1, 0, 1, -1], r"q2k\[1, 100, 1\] = 0 .* is a block id after -1 padding"),
        ([0, 1, 2, -1], r"q2k\[1, 100, 2\] = 2 .* is outside 0..1 \(the token's own block\)"),
        ([0, 1, 10**6, -1], r"q2k\[1, 100, 2\] = 1000000 .* outside 0..1"),
        ([-5, 0, 1, -1], r"q2k\[1, 100, 0\] = -5 .* outside 0..1"),
    ]
    for row, message in cases:
        bad = _edit(canon, 1, t, row)
        with pytest.raises(ValueError, match=message + r".*; expected select_blocks's canonical "
                                                       r"form"):
            validate_q2k(bad, msa)
        q = torch.zeros(msa.num_tokens, Q_HEADS, DIM, dtype=torch.bfloat16)
        kv = torch.zeros(msa.num_tokens, KV_HEADS, DIM, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=message):
            sparse_attention(q, kv, kv, bad, msa, backend="reference", validate=True)
        # Without validate the same q2k means its set: no error, even for 10**6 on the CPU.
        sparse_attention(q, kv, kv, bad, msa, backend="reference")


def test_the_op_hands_every_backend_the_canonical_form(monkeypatch):
    """sparse_attention canonicalizes a q2k made by hand before any backend reads it, and hands
    a canonical Selection (``select``'s) on unchanged (no copy, no sort): one meaning, whichever
    backend runs."""
    import dataclasses

    from nemo_msa.backends import registry as backends

    seen = []
    reference = backends.get_backend("reference")

    def forward(q, k, v, selection, view, scale, **kw):
        seen.append(selection)
        return reference.attention_forward(q, k, v, selection, view, scale, **kw)

    spy = dataclasses.replace(reference, name="spy", attention_forward=forward)
    monkeypatch.setitem(backends._REGISTRY, "spy", spy)
    msa = _layout()
    gen = torch.Generator().manual_seed(5)
    selection = select(torch.randn(msa.num_tokens, KV_HEADS, DIM, generator=gen),
                       torch.randn(msa.num_tokens, DIM, generator=gen), msa, top_k=TOP_K,
                       backend="reference")
    canon = selection.q2k
    messy = _scramble(canon, msa, 5, 2)
    q = torch.randn(msa.num_tokens, Q_HEADS, DIM).to(torch.bfloat16)
    kv = torch.randn(msa.num_tokens, KV_HEADS, DIM).to(torch.bfloat16)
    sparse_attention(q, kv, kv, selection, msa, backend="spy")
    sparse_attention(q, kv, kv, messy, msa, backend="spy")
    sparse_attention(q, kv, kv, canon, msa, backend="spy")  # a bare tensor: sorted once
    assert seen[0] is selection and seen[0].canonical
    assert torch.equal(seen[1].q2k[..., :TOP_K], canon)
    assert bool((seen[1].q2k[..., TOP_K:] == -1).all()) and seen[1].canonical
    assert seen[2].q2k is not canon and torch.equal(seen[2].q2k, canon)


@pytest.mark.gpu
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), extra=st.integers(0, 4))
def test_triton_op_and_gradients_mean_the_set(seed, extra):
    """The Triton backend on the GPU: a scrambled q2k gives bitwise the canonical call's output
    and gradients (the op brings it to the canonical form before the kernels)."""
    ids = torch.tensor([[1] * 70 + [2] * 50 + [0] * 8, [3] * 128]).cuda()
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=BLOCK)
    gen = torch.Generator().manual_seed(seed)
    index_q = torch.randn(msa.num_tokens, KV_HEADS, DIM, generator=gen).cuda().bfloat16()
    index_k = torch.randn(msa.num_tokens, DIM, generator=gen).cuda().bfloat16()
    canon = select_blocks(index_q, index_k, msa, top_k=TOP_K, backend="triton")
    messy = _scramble(canon.cpu(), msa, seed, extra).cuda()
    base = [torch.randn(msa.num_tokens, h, DIM, generator=gen).to(torch.bfloat16).cuda()
            for h in (Q_HEADS, KV_HEADS, KV_HEADS)]
    results = []
    for q2k in (canon, messy):
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = sparse_attention(q, k, v, q2k, msa, backend="triton")
        out.float().square().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)


def test_a_q2k_selected_for_another_block_size_is_refused():
    """A Selection remembers its block size: read with a layout of another block size it is an
    error naming both, not blocks of the wrong width."""
    ids = torch.tensor([[1] * 70 + [2] * 50 + [0] * 8, [3] * 128])
    wide = MSAMicrobatch.from_document_map(ids, block_size=32)
    narrow = MSAMicrobatch.from_document_map(ids, block_size=16)
    gen = torch.Generator().manual_seed(4)
    index_q = torch.randn(wide.num_tokens, KV_HEADS, DIM, generator=gen)
    index_k = torch.randn(wide.num_tokens, DIM, generator=gen)
    q2k = select(index_q, index_k, wide, top_k=2, backend="reference")
    q = torch.randn(wide.num_tokens, Q_HEADS, DIM).to(torch.bfloat16)
    kv = torch.randn(wide.num_tokens, KV_HEADS, DIM).to(torch.bfloat16)
    sparse_attention(q, kv, kv, q2k, wide, backend="reference")
    with pytest.raises(ValueError, match="ids of 32-token blocks .* block_size is 16"):
        sparse_attention(q, kv, kv, q2k, narrow, backend="reference")
