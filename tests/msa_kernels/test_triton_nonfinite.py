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
from nemo_msa.selection.naive import select_blocks_reference
from nemo_msa.selection.triton_select import triton_select_blocks
from nemo_msa.testing.containment import check_containment
from nemo_msa.testing.nonfinite import visible_pairs

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
    @staticmethod
    def forward(ctx, q, k, v, q2k, msa, scale):
        out, lse = triton_attention_forward(q, k, v, q2k, msa, scale, block_size=BS)
        ctx.save_for_backward(q, k, v, q2k, out, lse)
        ctx.msa, ctx.scale = msa, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, q2k, out, lse = ctx.saved_tensors
        grads = triton_attention_backward(dout.contiguous(), q, k, v, out, lse, q2k, ctx.msa,
                                          ctx.scale, block_size=BS)
        return (*grads, None, None, None)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("which,value,where", [
    ("v", math.nan, "last_of_block"), ("k", math.nan, "last_of_block"),
    ("v", math.inf, "mid_block"), ("k", math.nan, "mid_block"),
])
def test_sparse_attention_kernels_contain_a_non_finite_key_or_value(set_launch, schedule, which,
                                                                     value, where):
    set_launch(SCHEDULES[schedule])
    gen = torch.Generator().manual_seed(7)
    msa = make_layout(ROWS, SEQ, BS)
    t = msa.num_tokens
    q, dout = (torch.randn((t, HQ, D), generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn((t, HKV, D), generator=gen).to(torch.bfloat16) for _ in range(2))
    q2k = random_q2k(msa, HKV, TOP_K, BS, gen, drop_own=True)
    dmsa = layout_on_kernel_device(msa)
    dq2k = on_kernel_device(q2k)
    scale = 1.0 / math.sqrt(D)
    run = lambda q_, k_, v_: _Attention.apply(q_, k_, v_, dq2k, dmsa, scale)  # noqa: E731
    check_containment(run, q, k, v, dout, visible_pairs(msa, BS, q2k), scale, which,
                      *BAD[where], value, tol=1e-2, device=KERNEL_DEVICE)


SELECTIONS = {"triton": ("max",), "reference": ("max", "lse")}


@pytest.mark.parametrize("backend,score", [(b, s) for b in SELECTIONS for s in SELECTIONS[b]])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_selection_ignores_an_index_key_a_query_cannot_see(backend, score, value):
    """A NaN/Inf index key changes only the selection of the queries that see it (its
    document, positions >= its own); with the ``max`` score also the by-products (block
    score and arg-max key). The Triton kernel and the reference."""
    gen = torch.Generator().manual_seed(3)
    msa = make_layout(ROWS, SEQ, BS)
    t = msa.num_tokens
    iq = torch.randn((t, HKV, D), generator=gen).to(torch.bfloat16)
    ik = torch.randn((t, D), generator=gen).to(torch.bfloat16)
    kwargs = dict(top_k=3, init_blocks=1, local_blocks=1, score=score,
                  return_scores=score == "max")
    if backend == "triton":
        dmsa = layout_on_kernel_device(msa)
        select = lambda ik_: triton_select_blocks(*on_kernel_device(iq, ik_), dmsa, **kwargs)  # noqa: E731
    else:
        select = lambda ik_: select_blocks_reference(iq, ik_, msa, **kwargs)  # noqa: E731
    as_tuple = lambda r: tuple(x.cpu() for x in (r if score == "max" else (r,)))  # noqa: E731
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
