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
from _msa_support import make_layout, production_inputs, random_q2k, sparse_grads

from nemo_msa.attention.triton_bwd import triton_attention_backward
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.testing.oracle import attention_grads_f64, rel_err
from nemo_msa.triton.kernel_layout import kernel_layout

sm90 = pytest.mark.skipif(not torch.cuda.is_available()
                          or torch.cuda.get_device_capability() != (9, 0),
                          reason="the Gluon dq kernel compiles for SM90 (Hopper) only")

HQ, HKV, D, BS = 64, 4, 128, 128


def _inputs(lengths, seed, top_k=16):
    return production_inputs(lengths, seed, top_k, HQ, HKV, D, BS)


def _grads(dq_kernel, msa, q, k, v, dout, q2k, queries=None):
    return sparse_grads({"bwd.dq_kernel": dq_kernel}, msa, q, k, v, dout, q2k, queries)


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


def _walk_lists(q, k, v, dout, lse, delta, csr, view, token_pos, scale, block_size, ends):
    """Per (KV head, key block) list entry up to ``ends``: ``(tokens, heads, g, keys, p, ds)``
    of the sparse attention's backward in fp32 (what the Gluon kernels compute per step)."""
    hq, hkv = q.shape[1], k.shape[1]
    group, bound = hq // hkv, view.num_blocks_bound
    for seg in range(hkv * bound):
        lo, hi = int(csr.offsets[seg]), int(ends[seg])
        if lo >= hi:
            continue
        g, blk = divmod(seg, bound)
        doc, b = int(view.block_doc[blk]), int(view.block_local[blk])
        start, end = int(view.cu_seqlens[doc]), int(view.cu_seqlens[doc + 1])
        kpos = torch.arange(b * block_size, min((b + 1) * block_size, end - start))
        keys = start + kpos
        toks = csr.tokens[lo:hi].long()
        heads = torch.arange(g * group, (g + 1) * group)
        kk, vv = k[keys, g].float(), v[keys, g].float()
        s = q[toks][:, heads].float() @ kk.T * scale
        vis = kpos[None, None, :] <= token_pos[toks].long()[:, None, None]
        p = torch.where(vis, torch.exp(s - lse[heads][:, toks].T[..., None]), 0.0)
        dp = dout[toks][:, heads].float() @ vv.T
        ds = p * (dp - delta[heads][:, toks].T[..., None])
        yield toks, heads, g, keys, p, ds


def _reference_gluon_dq(q, k, v, dout, lse, delta, csr, view, token_pos, scale, block_size,
                        dq_acc, descriptors=None):
    ends = csr.lead_end if csr.lead_end is not None else csr.offsets[1:]
    for toks, heads, g, keys, _, ds in _walk_lists(q, k, v, dout, lse, delta, csr, view,
                                                   token_pos, scale, block_size, ends):
        dq_acc.index_put_((toks[:, None], heads[None, :]), ds @ k[keys, g].float(),
                          accumulate=True)


def _reference_gluon_dkdv(q, k, v, dout, lse, delta, csr, view, token_pos, scale, block_size,
                          dk, dv, descriptors=None):
    dk_acc = torch.zeros(dk.shape, dtype=torch.float32)
    dv_acc = torch.zeros(dv.shape, dtype=torch.float32)
    for toks, heads, g, keys, p, ds in _walk_lists(q, k, v, dout, lse, delta, csr, view,
                                                   token_pos, scale, block_size,
                                                   csr.offsets[1:]):
        dv_acc[keys, g] += torch.einsum("ngk,ngd->kd", p, dout[toks][:, heads].float())
        dk_acc[keys, g] += scale * torch.einsum("ngk,ngd->kd", ds, q[toks][:, heads].float())
    dk.copy_(dk_acc)
    dv.copy_(dv_acc)


@pytest.mark.parametrize("path", ["keys", "split"])
def test_the_key_major_host_path_with_reference_kernels(monkeypatch, set_launch, path):
    """The host side of ``bwd.dq_kernel="keys"`` / ``"split"`` on the CPU: the union dq kernel
    (interpreter) on the tiles whose union is small, the rows kernel's delta, accumulators and
    final dq, the CSR with the key-major rows leading, and dq / dk / dv against float64, with
    the two Gluon kernels replaced by torch loops that compute what they compute per step."""
    import nemo_msa.attention.triton_bwd as tb
    from nemo_msa.attention.triton_union import hybrid_plan

    monkeypatch.setattr(tb, "gluon_dkdv_supported", lambda *a: True)
    monkeypatch.setattr(tb, "query_side_descriptors", lambda *a: {})
    monkeypatch.setattr(tb, "gluon_dq", _reference_gluon_dq)
    monkeypatch.setattr(tb, "gluon_dkdv", _reference_gluon_dkdv)
    set_launch({"bwd.dq_kernel": path, "bwd.dq_union_qt": 4, "bwd.dq_union_max": 2})
    gen = torch.Generator().manual_seed(23)
    bs, hq, hkv, d, top_k = 16, 8, 2, 16, 3
    msa = make_layout([[45, 37, 6]], 96, bs)
    t = msa.num_tokens
    q, dout = (torch.randn((t, hq, d), generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn((t, hkv, d), generator=gen).to(torch.bfloat16) for _ in range(2))
    q2k = random_q2k(msa, hkv, top_k, bs, gen)
    scale = 1 / math.sqrt(d)
    out, lse = triton_attention_forward(q, k, v, q2k, msa, scale, block_size=bs)
    got = triton_attention_backward(dout, q, k, v, out, lse, q2k, msa, scale, block_size=bs)
    ref = attention_grads_f64(q, k, v, q2k, msa, scale, bs, dout)[2:]
    for name, x, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert rel_err(x, r) < 1e-2, (name, rel_err(x, r))
    if path == "split":
        plan = hybrid_plan(q2k, kernel_layout(msa, bs), 4, 2, 16, torch.zeros(1))
        union = plan.union_rows(kernel_layout(msa, bs), bs, hkv)
        assert union.any() and not union.all()
