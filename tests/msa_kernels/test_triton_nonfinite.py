"""NaN/Inf containment (issue 29) of the Triton kernels: selection, sparse attention forward
and backward (per-token, union and hybrid schedules), against the float64 rule.

A NaN or Inf in one (token, KV head) row of K or V must reach exactly the query rows that
attend to it (nemo_msa.testing.nonfinite); a NaN in one index key must not change the
selection of a query that cannot see it. Under the interpreter on the CPU, compiled on a GPU
(the same cases).
"""

from __future__ import annotations

import math

import pytest
import torch
from _msa_support import (
    KERNEL_DEVICE,
    layout_on_kernel_device,
    make_layout,
    on_kernel_device,
    random_q2k,
)

from nemo_msa.attention.triton_bwd import triton_attention_backward
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.indexer_loss import compute_indexer_loss, dense_indexer_loss_triton
from nemo_msa.indexer_loss.byproducts import block_scores_reference
from nemo_msa.indexer_loss.triton_byproducts import block_scores_triton
from nemo_msa.selection.naive import select_blocks_reference
from nemo_msa.selection.triton_select import triton_select_blocks
from nemo_msa.testing.containment import check_containment
from nemo_msa.testing.nonfinite import visible_pairs
from nemo_msa.testing.oracle import rel_err
from nemo_msa.triton.guards import nonfinite_row_counts
from nemo_msa.triton.kernel_layout import INTERPRET

BS, HQ, HKV, D, TOP_K = 16, 8, 2, 16, 2
ROWS, SEQ = [[70, 9], [33, 16, 1]], 80
# (compact row, KV head): the last token of block 0 of the 70-token document (the rows of its
# block before it must stay finite; later blocks' rows that did not select block 0 share
# union tiles with rows that did), and a token in the middle of the 33-token document's
# block 1 (a partial last block).
BAD = {"last_of_block": (15, 1), "mid_block": (79 + 20, 0)}
SCHEDULES = {
    "per_token": {"fwd.union_qt": 0, "bwd.dq_union_qt": 0},
    "union": {"fwd.union_qt": 4, "fwd.union_max": 1000, "bwd.dq_union_qt": 4,
              "bwd.dq_union_max": 1000},
    "hybrid": {"fwd.union_qt": 4, "fwd.union_max": 2, "bwd.dq_union_qt": 4,
               "bwd.dq_union_max": 2},
}


class _Attention(torch.autograd.Function):
    """The kernels' forward and backward; with ``reuse`` the backward takes the forward's union
    lists and NaN/Inf row counts (as the backend does), else dq builds and counts its own."""

    @staticmethod
    def forward(ctx, q, k, v, q2k, msa, scale, queries=None, reuse=False):
        out, lse, unions = triton_attention_forward(q, k, v, q2k, msa, scale, block_size=BS,
                                                    queries=queries, return_unions=True)
        ctx.save_for_backward(q, k, v, q2k, out, lse)
        ctx.msa, ctx.scale, ctx.queries = msa, scale, queries
        ctx.unions = unions if reuse else None
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, q2k, out, lse = ctx.saved_tensors
        grads = triton_attention_backward(dout.contiguous(), q, k, v, out, lse, q2k, ctx.msa,
                                          ctx.scale, block_size=BS, queries=ctx.queries,
                                          unions=ctx.unions)
        return (*grads, None, None, None, None, None)


def _random_case(seed: int):
    """``(msa, q, dout, k, v, q2k)``: the module's layout and random bf16 inputs on the host
    (q and dout [T, HQ, D], k and v [T, HKV, D]), with a selection that drops the own block."""
    gen = torch.Generator().manual_seed(seed)
    msa = make_layout(ROWS, SEQ, BS)
    t = msa.num_tokens
    q, dout = (torch.randn((t, HQ, D), generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn((t, HKV, D), generator=gen).to(torch.bfloat16) for _ in range(2))
    q2k = random_q2k(msa, HKV, TOP_K, BS, gen, drop_own=True)
    return msa, q, dout, k, v, q2k


#: The poisoned entries, in two complementary pairs: each holds a K and a V case, one at the end
#: of a block and one inside a partial block.
_POISON_A = [("v", math.nan, "last_of_block"), ("k", math.nan, "mid_block")]
_POISON_B = [("k", math.nan, "last_of_block"), ("v", math.inf, "mid_block")]


# The hybrid schedule (production: union and per-token programs in one launch) takes every
# poisoned entry; the pure schedules, whose programs it runs, one pair each (ADR 0038).
@pytest.mark.parametrize("schedule,which,value,where", [
    *(("per_token", *case) for case in _POISON_A),
    *(("union", *case) for case in _POISON_B),
    *(("hybrid", *case) for case in _POISON_A + _POISON_B),
])
def test_sparse_attention_kernels_contain_a_non_finite_key_or_value(set_launch, schedule, which,
                                                                     value, where):
    set_launch(SCHEDULES[schedule])
    msa, q, dout, k, v, q2k = _random_case(7)
    dmsa = layout_on_kernel_device(msa)
    dq2k = on_kernel_device(q2k)
    scale = 1.0 / math.sqrt(D)
    # The hybrid's dq takes the forward's lists and counts, as in production; the union
    # schedule's dq builds its own lists and counts the poisoned row itself.
    reuse = schedule == "hybrid"
    run = lambda q_, k_, v_: _Attention.apply(q_, k_, v_, dq2k, dmsa, scale, None,  # noqa: E731
                                              reuse)
    check_containment(run, q, k, v, dout, visible_pairs(msa, BS, q2k), scale, which,
                      *BAD[where], value, tol=1e-2, device=KERNEL_DEVICE)


@pytest.mark.parametrize("which,value", [("v", math.nan), ("k", math.inf)])
def test_sparse_attention_kernels_contain_with_a_query_subset(set_launch, which, value):
    """Context parallelism's launch (local queries against every token's keys, ADR 0021), union
    schedule: the same rule on the local rows."""
    set_launch(SCHEDULES["union"])
    gen = torch.Generator().manual_seed(17)
    msa = make_layout(ROWS, SEQ, BS)
    t = msa.num_tokens
    queries = torch.arange(1, t, 2)
    q, dout = (torch.randn((queries.numel(), HQ, D), generator=gen).to(torch.bfloat16)
               for _ in range(2))
    k, v = (torch.randn((t, HKV, D), generator=gen).to(torch.bfloat16) for _ in range(2))
    q2k = random_q2k(msa, HKV, TOP_K, BS, gen, drop_own=True)[:, queries]
    dmsa = layout_on_kernel_device(msa)
    dq2k, dqueries = on_kernel_device(q2k, queries)
    scale = 1.0 / math.sqrt(D)
    run = lambda q_, k_, v_: _Attention.apply(q_, k_, v_, dq2k, dmsa, scale,  # noqa: E731
                                              dqueries, True)
    check_containment(run, q, k, v, dout, visible_pairs(msa, BS, q2k, queries), scale, which,
                      *BAD["last_of_block"], value, tol=1e-2, device=KERNEL_DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nonfinite_row_counts_count_the_kv_rows_holding_a_nan_or_inf(dtype):
    """The running count the union kernels route their programs by (ADR 0032): a (token, KV
    head) row counts where K or V holds a NaN or +-Inf anywhere in it."""
    gen = torch.Generator().manual_seed(3)
    t, hkv, d = 70, 3, 24  # d not a power of two: the kernel pads its columns
    k, v = (torch.randn((t, hkv, d), generator=gen).to(dtype) for _ in range(2))
    for x, row, g, col, value in ((v, 15, 1, 3, math.nan), (k, 33, 0, 23, math.inf),
                                  (v, 33, 0, 0, -math.inf), (k, 69, 2, 0, math.nan),
                                  (v, 0, 2, 5, math.inf)):
        x[row, g, col] = value
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [T, Hkv]
    expected = torch.cumsum(bad.to(torch.int32), dim=0).T
    counts = nonfinite_row_counts(*on_kernel_device(k, v)).cpu()
    assert counts.dtype == torch.int32 and torch.equal(counts, expected), counts


# Under the interpreter the hybrid schedule (union programs beside per-token ones) runs the
# union kernels' guarded and unguarded launches; compiled, the union-only schedule too.
@pytest.mark.parametrize("schedule", [pytest.param("union", marks=pytest.mark.skipif(
    INTERPRET, reason="the [hybrid] case runs the same union launches under the interpreter")),
    "hybrid"])
def test_union_kernels_unguarded_launch_equals_the_guarded_one_on_finite_inputs(
        set_launch, monkeypatch, schedule):
    """On finite K and V every union program runs unguarded (ADR 0032); routing every program
    to the guarded launch instead (each row counted non-finite) gives the same output, LSE,
    block mass and gradients bit for bit: a row that did not select a block has probability
    exactly 0 and factor exactly 1 there, so dropping the select changes nothing."""
    import nemo_msa.attention.triton_bwd as triton_bwd
    import nemo_msa.attention.triton_fwd as triton_fwd

    set_launch(SCHEDULES[schedule])
    msa, q, dout, k, v, q2k = _random_case(23)
    dmsa = layout_on_kernel_device(msa)
    dq, dk, dv, dq2k, ddout = on_kernel_device(q, k, v, q2k, dout)

    def run():
        # dq takes the forward's union lists and NaN/Inf row counts (the backend's path);
        # in the guarded run those counts name every row.
        out, lse, unions, mass = triton_attention_forward(dq, dk, dv, dq2k, dmsa, block_size=BS,
                                                          return_unions=True,
                                                          return_block_mass=True)
        grads = triton_attention_backward(ddout, dq, dk, dv, out, lse, dq2k, dmsa,
                                          block_size=BS, unions=unions)
        return [x.cpu() for x in (out, lse, mass, *grads)]

    unguarded = run()
    every_row = lambda k_, v_: torch.arange(  # noqa: E731
        1, k_.shape[0] + 1, dtype=torch.int32, device=k_.device).expand(k_.shape[1], -1)
    monkeypatch.setattr(triton_fwd, "nonfinite_row_counts", every_row)
    monkeypatch.setattr(triton_bwd, "nonfinite_row_counts", every_row)
    guarded = run()
    for name, a, b in zip(("out", "lse", "mass", "dq", "dk", "dv"), unguarded, guarded,
                          strict=True):
        # lse is -inf for a query that sees no key (its own block dropped here).
        assert not torch.isnan(a).any() and (name == "lse" or torch.isfinite(a).all()), name
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


def test_dq_takes_the_forwards_nonfinite_counts_only_for_the_same_k_and_v(set_launch):
    """The forward's union lists carry its NaN/Inf row counts to dq (two launches fewer per
    backward); dq counts again for other k / v, or ones changed in place since the forward
    (a NaN written into V after the forward must still route its programs to the guard)."""
    from nemo_msa.attention.triton_bwd import _forward_nonfinite

    set_launch(SCHEDULES["union"])
    msa, q, _, k, v, q2k = _random_case(5)
    dq_, dk, dv, dq2k = on_kernel_device(q, k, v, q2k)
    _, _, unions = triton_attention_forward(dq_, dk, dv, dq2k, layout_on_kernel_device(msa),
                                            block_size=BS, return_unions=True)
    assert unions.nonfinite is not None and not unions.nonfinite.any()
    assert _forward_nonfinite(unions, {"k_ptr": dk, "v_ptr": dv}) is unions.nonfinite
    assert _forward_nonfinite(unions, {"k_ptr": dk.clone(), "v_ptr": dv}) is None
    dv[3, 0, 0] = math.nan  # in place: a new version of v
    assert _forward_nonfinite(unions, {"k_ptr": dk, "v_ptr": dv}) is None
    assert _forward_nonfinite(None, {"k_ptr": dk, "v_ptr": dv}) is None


SELECTIONS = {"triton": ("max",), "reference": ("max", "lse")}


@pytest.mark.parametrize("backend,score", [(b, s) for b in SELECTIONS for s in SELECTIONS[b]])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_selection_ignores_an_index_key_a_query_cannot_see(backend, score, value):
    """A NaN/Inf index key changes only the selection of the queries that see it (its
    document, positions >= its own); with the ``max`` score also the sparse indexer loss's
    block scores and argmax keys of the selected blocks. The Triton kernels and the
    references."""
    gen = torch.Generator().manual_seed(3)
    msa = make_layout(ROWS, SEQ, BS)
    t = msa.num_tokens
    iq = torch.randn((t, HKV, D), generator=gen).to(torch.bfloat16)
    ik = torch.randn((t, D), generator=gen).to(torch.bfloat16)
    kwargs = dict(top_k=3, init_blocks=1, local_blocks=1, score=score)
    if backend == "triton":
        dmsa = layout_on_kernel_device(msa)

        def select(ik_):
            q_, k_ = on_kernel_device(iq, ik_)
            ids = triton_select_blocks(q_, k_, dmsa, **kwargs)
            return (ids, *block_scores_triton(q_, k_, ids, dmsa)[:2])
    else:
        def select(ik_):
            ids = select_blocks_reference(iq, ik_, msa, **kwargs)
            if score != "max":
                return (ids,)
            return (ids, *block_scores_reference(iq.float(), ik_.float(), ids, msa))
    as_tuple = lambda r: tuple(x.cpu() for x in r)  # noqa: E731
    clean = as_tuple(select(ik))
    for token in (15, 79 + 20):
        bad = ik.clone()
        bad[token] = value
        got = as_tuple(select(bad))
        sees = visible_pairs(msa, BS)[0, :, token]  # [T]
        assert sees.sum() > 0 and (~sees).sum() > 0
        for a, b in zip(got, clean, strict=True):
            same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
            assert same[:, ~sees].all(), f"token {token}: selection of unseeing queries changed"


def _dense_loss(backend, iq, ik, q, k, msa, dmsa):
    """d index_q [T, G, di] and d index_k [T, di] of the dense indexer loss (fp32, host)."""
    if backend == "triton":
        iq, ik, q, k = (x.clone() for x in on_kernel_device(iq, ik, q, k))
        iq, ik = iq.requires_grad_(True), ik.requires_grad_(True)
        loss, _ = dense_indexer_loss_triton(iq, ik, q, k, dmsa, softmax_scale=0.3,
                                            num_index_heads_total=iq.shape[1], loss_coeff=1.0)
    else:
        iq, ik, q, k = (x.double() for x in (iq, ik, q, k))
        iq, ik = iq.requires_grad_(True), ik.requires_grad_(True)
        loss, _ = compute_indexer_loss(iq, ik, q, k, msa, softmax_scale=0.3,
                                       num_index_heads_total=iq.shape[1], loss_coeff=1.0,
                                       score_type="max", query_chunk=32)
    loss.backward()
    return iq.grad.float().cpu(), ik.grad.float().cpu()


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("which", ["key", "index_k"])
def test_dense_indexer_loss_contains_a_nan_key(backend, which):
    """A NaN attention key (one KV group) or index key changes no gradient of the rows that do
    not see it: d index_q of every other (token, head) and d index_k of every key no affected
    row sees equal those of the clean inputs, finite."""
    gen = torch.Generator().manual_seed(11)
    msa = make_layout(ROWS, SEQ, BS)
    t, heads, group = msa.num_tokens, HKV, 2
    iq = torch.randn(t, heads, D, generator=gen).to(torch.bfloat16)
    ik = torch.randn(t, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(t, heads * group, D, generator=gen).to(torch.bfloat16)
    k = torch.randn(t, heads, D, generator=gen).to(torch.bfloat16)
    dmsa = layout_on_kernel_device(msa)
    clean_dq, clean_dk = _dense_loss(backend, iq, ik, q, k, msa, dmsa)
    token, head = BAD["last_of_block"]
    bad_k, bad_ik = k.clone(), ik.clone()
    if which == "key":
        bad_k[token, head] = float("nan")
    else:
        bad_ik[token] = float("nan")
    dq, dk = _dense_loss(backend, iq, bad_ik, q, bad_k, msa, dmsa)
    visible = visible_pairs(msa, BS, kv_heads=heads)
    affected = visible[:, :, token].t().clone()  # [T, G]: the (token, head) rows that see it
    if which == "key":
        affected[:, 1 - head] = False
    keys = ~(visible & affected.t()[:, :, None]).any(1).any(0)  # no affected row sees them
    keys[token] = False
    assert affected.any() and (~affected).any() and keys.any()
    assert torch.isfinite(dq[~affected]).all() and torch.isfinite(dk[keys]).all()
    assert rel_err(dq[~affected], clean_dq[~affected]) < 1e-6
    assert rel_err(dk[keys], clean_dk[keys]) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("which,value", [("v", math.nan), ("k", math.nan), ("v", math.inf)])
def test_gpu_sparse_attention_contains_at_the_production_block_and_head_shape(which, value):
    """The default launch (hybrid union / per-token forward and dq, TMA whole blocks) at block
    128, d 128 and GQA 16, compiled, through the public op."""
    from nemo_msa.ops import sparse_attention

    rows, seq, bs, hq, hkv, d = [[400, 40], [256, 130]], 512, 128, 16, 1, 128
    gen = torch.Generator().manual_seed(9)
    msa = make_layout(rows, seq, bs)
    t = msa.num_tokens
    q, dout = (torch.randn((t, hq, d), generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn((t, hkv, d), generator=gen).to(torch.bfloat16) for _ in range(2))
    q2k = random_q2k(msa, hkv, 3, bs, gen, drop_own=True)
    dmsa = layout_on_kernel_device(msa)
    dq2k = on_kernel_device(q2k)
    scale = 1.0 / math.sqrt(d)
    run = lambda q_, k_, v_: sparse_attention(q_, k_, v_, dq2k, dmsa, softmax_scale=scale,  # noqa: E731
                                              backend="triton")
    visible = visible_pairs(msa, bs, q2k)
    for token in (127, 440 + 200):  # the last token of block 0; one inside block 1
        check_containment(run, q, k, v, dout, visible, scale, which, token, 0, value, tol=1e-2,
                          device=KERNEL_DEVICE)
