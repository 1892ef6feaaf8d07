"""NaN/Inf containment (issue 29) of the reference sparse op and the dense document paths.

A NaN or Inf in one (token, KV head) row of K or V must reach exactly the query rows that
attend to it (same document, causally visible, selected): nemo_msa.testing.nonfinite's float64
rule, checked by nemo_msa.testing.containment. Forward and backward, on packed rows of
documents of several lengths (the bad token is the last of a full block, the issue's case, or
in the middle of a block).
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_msa import MSAMicrobatch
from nemo_msa.attention.dense import (
    dense_document_attention_per_document,
    dense_document_attention_queries,
    dense_document_attention_rows,
)
from nemo_msa.attention.finite import finite_keys_and_values, mark_attending_rows
from nemo_msa.ops import sparse_attention
from nemo_msa.testing.containment import check_containment
from nemo_msa.testing.nonfinite import visible_pairs
from nemo_msa.testing.packs import document_map_from_lengths

BS = 16
ROWS = [[37, 11, 16], [32, 1, 20]]  # documents 0..2 in row 0, 3..5 in row 1
SEQ = 64
HQ, HKV, D, TOP_K = 4, 2, 16, 2
# (compact row, KV head): the last token of a full block of a 32-token document (the issue's
# case: the earlier rows of its block must stay finite), and a token in the middle of a block.
BAD = {"last_of_block": (64 + 15, 1), "mid_block": (20, 0)}
CASES = [(w, val, where) for w in ("k", "v") for val in (math.nan, math.inf)
         for where in BAD]


def _layout() -> MSAMicrobatch:
    return MSAMicrobatch.from_document_map(document_map_from_lengths(ROWS, SEQ), block_size=BS)


def _inputs(msa, dtype, seed=0, tq=None):
    gen = torch.Generator().manual_seed(seed)
    t = msa.num_tokens
    tq = t if tq is None else tq
    q, dout = (torch.randn((tq, HQ, D), generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn((t, HKV, D), generator=gen).to(dtype) for _ in range(2))
    return q, k, v, dout


def _q2k(msa, seed=1):
    """A selection per (KV head, token): the own block and one random earlier block (or none),
    so rows of one tile select different blocks."""
    gen = torch.Generator().manual_seed(seed)
    pos = msa.document_positions.tolist()
    q2k = torch.full((HKV, msa.num_tokens, TOP_K), -1, dtype=torch.int32)
    for g in range(HKV):
        for i, p in enumerate(pos):
            own = p // BS
            pick = int(torch.randint(0, own + 1, (1,), generator=gen)) if own else own
            q2k[g, i, : len({pick, own})] = torch.tensor(sorted({pick, own}), dtype=torch.int32)
    return q2k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("which,value,where", CASES)
def test_reference_sparse_attention_contains_a_non_finite_key_or_value(dtype, which, value,
                                                                        where):
    msa = _layout()
    q, k, v, dout = _inputs(msa, dtype)
    q2k = _q2k(msa)
    scale = 1.0 / math.sqrt(D)
    run = lambda q_, k_, v_: sparse_attention(q_, k_, v_, q2k, msa, softmax_scale=scale,  # noqa: E731
                                              backend="reference")
    check_containment(run, q, k, v, dout, visible_pairs(msa, BS, q2k), scale, which,
                      *BAD[where], value, tol=1e-5)


@pytest.mark.parametrize("which,value,where", CASES)
def test_reference_sparse_attention_query_subset_contains(which, value, where):
    msa = _layout()
    queries = torch.arange(0, msa.num_tokens, 3)
    q, k, v, dout = _inputs(msa, torch.float32, tq=queries.numel())
    q2k = _q2k(msa)[:, queries]
    scale = 1.0 / math.sqrt(D)
    run = lambda q_, k_, v_: sparse_attention(q_, k_, v_, q2k, msa, softmax_scale=scale,  # noqa: E731
                                              backend="reference", queries=queries)
    check_containment(run, q, k, v, dout, visible_pairs(msa, BS, q2k, queries), scale, which,
                      *BAD[where], value, tol=1e-5)


DENSE_PATHS = {
    "rows": dense_document_attention_rows,
    "per_document": dense_document_attention_per_document,
}


@pytest.mark.parametrize("path", sorted(DENSE_PATHS))
@pytest.mark.parametrize("which,value,where", CASES)
def test_dense_document_attention_contains_a_non_finite_key_or_value(path, which, value,
                                                                      where):
    """The CPU's fp32 dense path (per packed row, masked SDPA: one NaN used to reach every row
    of its packed row) and the per-document path (the GPU's cuDNN path, here on torch's CPU
    kernel)."""
    msa = _layout()
    q, k, v, dout = _inputs(msa, torch.float32)
    scale = 1.0 / math.sqrt(D)
    fn = DENSE_PATHS[path]
    run = lambda q_, k_, v_: fn(q_, k_, v_, msa, scale)  # noqa: E731
    check_containment(run, q, k, v, dout, visible_pairs(msa, BS, kv_heads=HKV), scale, which,
                      *BAD[where], value, tol=1e-5)


@pytest.mark.parametrize("which,value,where", CASES)
def test_dense_query_runs_contain_a_non_finite_key_or_value(which, value, where):
    msa = _layout()
    queries = torch.arange(1, msa.num_tokens, 2)
    q, k, v, dout = _inputs(msa, torch.float32, tq=queries.numel())
    scale = 1.0 / math.sqrt(D)
    run = lambda q_, k_, v_: dense_document_attention_queries(q_, k_, v_, msa, scale, queries)  # noqa: E731
    check_containment(run, q, k, v, dout, visible_pairs(msa, BS, queries=queries, kv_heads=HKV),
                      scale, which, *BAD[where], value, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("which,value", [("v", math.nan), ("k", math.nan), ("v", math.inf)])
def test_gpu_dense_attention_contains_a_non_finite_key_or_value(which, value):
    """The GPU's dense path (cuDNN, else flash SDPA per run of equal-length documents, bf16,
    padded lengths) at the production head shape: the SDPA kernels mix masked columns of the
    diagonal tile, so this checks the containment around them."""
    from nemo_msa.attention.dense import dense_document_attention

    rows, seq, hq, hkv, d = [[300, 77, 128], [128, 128, 100]], 512, 16, 1, 128
    msa = MSAMicrobatch.from_document_map(document_map_from_lengths(rows, seq), block_size=128)
    gen = torch.Generator().manual_seed(5)
    t = msa.num_tokens
    q, dout = (torch.randn((t, hq, d), generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn((t, hkv, d), generator=gen).to(torch.bfloat16) for _ in range(2))
    dmsa = MSAMicrobatch.from_document_map(document_map_from_lengths(rows, seq, "cuda"),
                                           block_size=128)
    scale = 1.0 / math.sqrt(d)
    run = lambda q_, k_, v_: dense_document_attention(q_, k_, v_, dmsa, scale)  # noqa: E731
    visible = visible_pairs(msa, 128, kv_heads=hkv)
    # The last token of a full 128-token document, and one inside the 300-token document.
    for token in (300 + 77 + 127, 200):
        check_containment(run, q, k, v, dout, visible, scale, which, token, 0, value, tol=1e-2,
                          device="cuda")



@pytest.mark.parametrize("seed", [0, 1, 2])
def test_finite_keys_and_values_reached_rows_per_head(seed):
    """The rows reached by non-finite keys or values, per KV head, against a direct scan: several
    bad (token, head) rows in several documents and heads, so a count leaking across documents
    or heads would show."""
    msa = _layout()
    t, hkv = msa.num_tokens, 3
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn((t, hkv, D), generator=gen) for _ in range(2))
    for _ in range(5):
        row, head, col = (int(torch.randint(n, (1,), generator=gen)) for n in (t, hkv, D))
        (k if torch.rand((), generator=gen) < 0.5 else v)[row, head, col] = math.inf
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
    docs, pos = msa.token_documents.tolist(), msa.document_positions.tolist()
    expected = torch.zeros((t, hkv), dtype=torch.bool)
    for i in range(t):
        first = i - pos[i]
        assert docs[first] == docs[i]
        expected[i] = bad[first:i + 1].any(0)
    k0, v0, reached = finite_keys_and_values(k, v, msa)
    assert torch.equal(reached, expected)
    assert expected.any() and not expected.all()
    assert torch.isfinite(k0).all() and torch.isfinite(v0).all()
    assert torch.equal(k0[~bad], k[~bad]) and torch.equal(v0[~bad], v[~bad])
    queries = torch.tensor([0, 20, 64 + 31, t - 1])
    assert torch.equal(finite_keys_and_values(k, v, msa, queries)[2], expected[queries])


@pytest.mark.parametrize("permuted", [False, True])
def test_mark_attending_rows_per_kv_head(permuted):
    """Every query head of a reached (row, KV head) is NaN, every other element is out's value
    bit for bit, and the gradient is 0 exactly where NaN was set; on a contiguous and on a
    permuted (non-contiguous) tensor, with the head-major mask the scan gives."""
    gen = torch.Generator().manual_seed(3)
    tq, hkv, group, d = 64, 4, 3, 8
    base = torch.randn((hkv * group, tq, d), generator=gen, dtype=torch.float64)
    out = (base.permute(1, 0, 2) if permuted else base.permute(1, 0, 2).contiguous())
    out.requires_grad_(True)
    # Head-major, as finite_keys_and_values returns it.
    reached = (torch.rand((hkv, tq), generator=gen) < 0.4).t()
    assert reached.any() and not reached.all()
    marked = mark_attending_rows(out, reached)
    assert marked.shape == out.shape and marked.dtype == out.dtype
    # Laid out as the output, not as the mask: flattening the heads back is a view, no copy.
    assert type(marked.grad_fn).__name__ == "ViewBackward0", marked.grad_fn
    assert type(marked.grad_fn.next_functions[0][0]).__name__ == "WhereBackward0"
    rows = reached.repeat_interleave(group, dim=1)  # [Tq, Hq]: head h reads KV head h // group
    assert torch.isnan(marked[rows]).all()
    assert torch.equal(marked[~rows], out.detach()[~rows])
    grad = torch.randn(marked.shape, generator=gen, dtype=torch.float64)
    marked.backward(grad)
    assert torch.equal(out.grad[rows], torch.zeros_like(out.grad[rows]))
    assert torch.equal(out.grad[~rows], grad[~rows])
