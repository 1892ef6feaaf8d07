"""The Gluon dk/dv kernel (SM90) against the Triton dk/dv kernel and the float64 oracle.

The two kernels compute one function: the same gradients up to bf16 rounding, the same NaN
pattern where a K/V row holds a NaN (ADR 0025), zeros for keys no query selected, and the same
query-subset (context-parallel) contributions. Those tests are marked ``gpu``: the kernel
compiles only for a Hopper GPU, so they are skipped with the reason elsewhere (the interpreter
runs the Triton one). The host side's row words are checked on any machine.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_msa import MSAMicrobatch, select_blocks
from nemo_msa.attention.gluon_dkdv import row_stats
from nemo_msa.attention.triton_bwd import triton_attention_backward
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.testing.oracle import attention_grads_f64, rel_err
from nemo_msa.triton.tiles import LOG2E

sm90 = pytest.mark.skipif(not torch.cuda.is_available()
                          or torch.cuda.get_device_capability() != (9, 0),
                          reason="the Gluon dk/dv kernel compiles for SM90 (Hopper) only")

HQ, HKV, D, BS = 64, 4, 128, 128


def _inputs(lengths, seed, top_k=16):
    """bf16 production-topology inputs over documents of ``lengths`` (one row) and a q2k from
    the Triton selection of random index queries."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    msa = MSAMicrobatch.build(packed_seq_ids=ids.cuda(), block_size=BS)
    t = msa.num_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    q, k, v, dout = rnd(t, HQ, D), rnd(t, HKV, D), rnd(t, HKV, D), rnd(t, HQ, D)
    q2k = select_blocks(rnd(t, HKV, D), rnd(t, D), msa, top_k=top_k, backend="triton")
    return msa, q, k, v, dout, q2k


def _grads(kernel, msa, q, k, v, dout, q2k, queries=None):
    scale = 1 / math.sqrt(D)
    rows = slice(None) if queries is None else queries
    out, lse = triton_attention_forward(q[rows], k, v, q2k[:, rows], msa, scale,
                                        queries=queries)
    # The kernel as a layer's plan names it: a Gluon call it cannot take fails, never runs the
    # Triton kernel in its place.
    return triton_attention_backward(dout[rows], q[rows], k, v, out, lse, q2k[:, rows], msa,
                                     scale, queries=queries, dkdv=kernel)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("lengths,top_k", [
    ([2304], 16),             # 18 blocks: beyond top-16, long lists on the early blocks
    ([1000, 1400, 377], 16),  # partial last blocks, documents shorter than top-16 blocks
    ([2000], 4),              # few slots per query
])
def test_gluon_dkdv_matches_the_triton_kernel_and_float64(lengths, top_k):
    msa, q, k, v, dout, q2k = _inputs(lengths, seed=len(lengths) + top_k, top_k=top_k)
    # No query keeps block 2 of any document (a legal q2k: its keys get zero dk/dv).
    q2k = torch.where(q2k == 2, -1, q2k)
    _, dk_t, dv_t = _grads("triton", msa, q, k, v, dout, q2k)
    _, dk_g, dv_g = _grads("gluon", msa, q, k, v, dout, q2k)
    *_, dk64, dv64 = attention_grads_f64(q.cpu(), k.cpu(), v.cpu(), q2k.cpu(), msa,
                                         1 / math.sqrt(D), BS, dout.cpu())
    for name, got, triton_, ref in (("dk", dk_g.cpu(), dk_t.cpu(), dk64),
                                    ("dv", dv_g.cpu(), dv_t.cpu(), dv64)):
        err = rel_err(got, ref)
        assert 1e-4 < err < 1e-2 and not math.isnan(err), (name, err)
        assert rel_err(got, triton_) < 5e-3, (name, rel_err(got, triton_))
        unselected = ref.abs().sum(-1) == 0
        assert unselected.sum() >= 128 * HKV, name
        assert torch.equal(got[unselected], torch.zeros_like(got[unselected])), name


@pytest.mark.gpu
@sm90
def test_gluon_dkdv_contains_nonfinite_rows_like_the_triton_kernel():
    msa, q, k, v, dout, q2k = _inputs([2000, 1100], seed=3)
    k[700, 1, 5] = float("nan")
    v[2500, 2, :] = float("inf")
    _, dk_t, dv_t = _grads("triton", msa, q, k, v, dout, q2k)
    _, dk_g, dv_g = _grads("gluon", msa, q, k, v, dout, q2k)
    for name, got, want in (("dk", dk_g, dk_t), ("dv", dv_g, dv_t)):
        bad = ~torch.isfinite(want)
        assert bad.any(), name
        assert torch.equal(~torch.isfinite(got), bad), name
        assert rel_err(got[~bad], want[~bad]) < 5e-3, name


@pytest.mark.gpu
@sm90
def test_gluon_dkdv_query_subset_matches_the_triton_kernel():
    msa, q, k, v, dout, q2k = _inputs([2300, 900], seed=5)
    queries = torch.arange(1, msa.num_tokens, 3, device="cuda")
    _, dk_t, dv_t = _grads("triton", msa, q, k, v, dout, q2k, queries)
    _, dk_g, dv_g = _grads("gluon", msa, q, k, v, dout, q2k, queries)
    for name, got, want in (("dk", dk_g, dk_t), ("dv", dv_g, dv_t)):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < 5e-3, (name, rel_err(got, want))


def test_row_stats_put_each_row_where_the_kernel_reads_it():
    """Row (t, g G + i) of the stats: log2-domain LSE at 2 (t Hq + g G) + i, delta G words on;
    a non-finite delta makes delta 0 and the LSE NaN; token t's position at t G .. t G + G - 1;
    every word belongs to exactly one row."""
    g = torch.Generator().manual_seed(0)
    t, group = 37, HQ // HKV
    lse, delta = torch.randn(HQ, t, generator=g), torch.randn(HQ, t, generator=g)
    delta[5, 3], delta[17, 30] = float("nan"), float("inf")
    pos = torch.randint(0, 1000, (t,), generator=g)
    stats, positions = row_stats(lse, delta, pos, HKV)
    head = torch.arange(HQ)[None, :]
    at = 2 * (torch.arange(t)[:, None] * HQ + head // group * group) + head % group
    ok = torch.isfinite(delta.t())
    assert torch.equal(stats[at].isnan(), ~ok)
    assert torch.equal(stats[at][ok], (lse.t() * LOG2E)[ok])
    assert torch.equal(stats[at + group], torch.where(ok, delta.t(), 0.0))
    assert torch.equal(torch.cat([at, at + group]).flatten().sort().values,
                       torch.arange(stats.numel()))
    assert positions.dtype == torch.int32
    assert torch.equal(positions.view(t, group), pos[:, None].expand(t, group).int())
