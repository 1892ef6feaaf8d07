"""The key-major Gluon dq kernel (SM90, ADR 0044) against the dq kernels and the float64 oracle.

The backward with ``bwd.dq_kernel="keys"`` or ``"split"`` computes the same function as with
the query-major dq kernels: the same gradients up to bf16 rounding and fp32 summation order, the
same NaN pattern where a K/V row holds a NaN (ADR 0025), the same query-subset
(context-parallel) gradients, and exactly the dq kernels' result under
``torch.use_deterministic_algorithms``.
The kernel compiles only for a Hopper GPU, so these tests are marked ``gpu`` and skipped with
the reason elsewhere; ``benchmarks/kernel_report.py --kernel dq_gluon`` compiles it anywhere
(``tests/msa_kernels/test_kernel_report.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_msa import MSAMicrobatch, select_blocks
from nemo_msa.attention.triton_bwd import triton_attention_backward
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.testing.oracle import attention_grads_f64, rel_err
from nemo_msa.triton.launch import launch_overrides

sm90 = pytest.mark.skipif(not torch.cuda.is_available()
                          or torch.cuda.get_device_capability() != (9, 0),
                          reason="the Gluon dq kernel compiles for SM90 (Hopper) only")

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


def _grads(dq_kernel, msa, q, k, v, dout, q2k, queries=None):
    scale = 1 / math.sqrt(D)
    rows = slice(None) if queries is None else queries
    out, lse = triton_attention_forward(q[rows], k, v, q2k[:, rows], msa, scale,
                                        queries=queries)
    with launch_overrides({"bwd.dq_kernel": dq_kernel}):
        return triton_attention_backward(dout[rows], q[rows], k, v, out, lse, q2k[:, rows], msa,
                                         scale, queries=queries)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("lengths,top_k", [
    ([2304], 16),             # 18 blocks: beyond top-16, long lists on the early blocks
    ([1000, 1400, 377], 16),  # partial last blocks, documents shorter than top-16 blocks
    ([2000], 4),              # few slots per query
])
def test_key_major_dq_matches_the_dq_kernels_and_float64(lengths, top_k):
    msa, q, k, v, dout, q2k = _inputs(lengths, seed=len(lengths) + top_k, top_k=top_k)
    q2k = torch.where(q2k == 2, -1, q2k)
    tokens = _grads("tokens", msa, q, k, v, dout, q2k)
    ref = attention_grads_f64(q.cpu(), k.cpu(), v.cpu(), q2k.cpu(), msa, 1 / math.sqrt(D), BS,
                              dout.cpu())[2:]
    for path in ("keys", "split"):
        got_all = _grads(path, msa, q, k, v, dout, q2k)
        for name, got, want, r in zip(("dq", "dk", "dv"), got_all, tokens, ref, strict=True):
            err = rel_err(got.cpu(), r)
            assert 1e-4 < err < 1e-2 and not math.isnan(err), (path, name, err)
            assert rel_err(got, want) < 5e-3, (path, name, rel_err(got, want))


@pytest.mark.gpu
@sm90
def test_key_major_dq_contains_nonfinite_rows_like_the_dq_kernels():
    msa, q, k, v, dout, q2k = _inputs([2000, 1100], seed=3)
    k[700, 1, 5] = float("nan")
    v[2500, 2, :] = float("inf")
    tokens = _grads("tokens", msa, q, k, v, dout, q2k)
    for path in ("keys", "split"):
        got_all = _grads(path, msa, q, k, v, dout, q2k)
        for name, got, want in zip(("dq", "dk", "dv"), got_all, tokens, strict=True):
            bad = ~torch.isfinite(want)
            assert bad.any(), name
            assert torch.equal(~torch.isfinite(got), bad), (path, name)
            assert rel_err(got[~bad], want[~bad]) < 5e-3, (path, name)


@pytest.mark.gpu
@sm90
def test_key_major_dq_query_subset_matches_the_dq_kernels():
    msa, q, k, v, dout, q2k = _inputs([2300, 900], seed=5)
    queries = torch.arange(1, msa.num_tokens, 3, device="cuda")
    tokens = _grads("tokens", msa, q, k, v, dout, q2k, queries)
    for path in ("keys", "split"):
        got_all = _grads(path, msa, q, k, v, dout, q2k, queries)
        for name, got, want in zip(("dq", "dk", "dv"), got_all, tokens, strict=True):
            assert torch.isfinite(got).all(), (path, name)
            assert rel_err(got, want) < 5e-3, (path, name, rel_err(got, want))


@pytest.mark.gpu
@sm90
def test_deterministic_algorithms_keep_the_dq_kernels():
    """Under torch.use_deterministic_algorithms(True) the backward runs the dq kernels (no
    atomics): the same bits as ``bwd.dq_kernel="tokens"``, run after run."""
    msa, q, k, v, dout, q2k = _inputs([1500, 700], seed=7)
    want = _grads("tokens", msa, q, k, v, dout, q2k)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_grads(path, msa, q, k, v, dout, q2k) for path in ("keys", "split")]
    finally:
        torch.use_deterministic_algorithms(before)
    for got in runs:
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
