"""The Triton kernels' query-subset mode (context parallelism, ADR 0021) against the full run.

One CP rank runs its local queries (Megatron's load-balanced chunks r and 2N-1-r of every row)
against the whole sequence's keys. Every kernel's subset result must be the rows of the
full-sequence result: selection ids and by-products, attention output / lse / block mass and dq
rows, and dk / dv equal to the full run's with the other queries' dout zeroed; the fused dense
indexer loss adds up over the ranks to the one-rank loss. Float64 oracles check the subset
rows too. Layouts hold documents that straddle the chunk boundaries, one shorter than a chunk,
and padding. Under the interpreter the full and subset runs execute the same float operations,
so the comparisons are bitwise except dk / dv, whose per-block query lists are grouped in
tiles differently (fp32 sums in another order); compiled, the hybrid split may differ too, and
a tolerance stands in where it can.
"""

from __future__ import annotations

import math

import pytest
import torch
from _msa_support import KERNEL_DEVICE, layout_on_kernel_device, make_layout, random_q2k

from nemo_msa import MSAMicrobatch, QueryView, Selection
from nemo_msa.attention.triton_bwd import triton_attention_backward
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.backends.triton import BACKEND
from nemo_msa.context_parallel import load_balanced_indices
from nemo_msa.indexer_loss import compute_indexer_loss, dense_indexer_loss_triton
from nemo_msa.selection.triton_select import triton_select_blocks
from nemo_msa.testing.oracle import (
    attention_grads_f64,
    attention_rows_f64,
    rel_err,
    select_rows_f64,
)
from nemo_msa.testing.packs import document_map_from_lengths
from nemo_msa.triton.kernel_layout import INTERPRET, query_subset

TOL = 1e-2  # bf16 operands vs float64 (MSA_SPEC.md)
#: Rows [[1, 32, 21], [16, 3]] of 64 columns: chunks of 16 (CP=2) or 8 (CP=4) columns; the
#: 32- and 21-token documents straddle chunk boundaries, the 3-token one is shorter than a
#: chunk, both rows end in padding.
ROWS, SEQ, BS = [[1, 32, 21], [16, 3]], 64, 16
#: Launch schedules: per-token kernels only, union kernels for every tile, and a mix.
SCHEDULES = {
    "per_token": {"fwd.union_qt": 0, "bwd.dq_union_qt": 0},
    "union": {"fwd.union_qt": 8, "fwd.union_max": 64, "bwd.dq_union_qt": 8,
              "bwd.dq_union_max": 64},
    "mixed": {"fwd.union_qt": 4, "fwd.union_max": 3, "bwd.dq_union_qt": 4,
              "bwd.dq_union_max": 3},
}


def local_queries(msa, cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 [Tq]: the global compact rows of the rank's real tokens, ascending."""
    cols = load_balanced_indices(msa.seq_len, cp_size, cp_rank)
    flat = (torch.arange(msa.batch_size)[:, None] * msa.seq_len + cols[None]).reshape(-1)
    return torch.isin(msa.token_rows.cpu(), flat).nonzero().squeeze(1)


def _ranks():
    """Both ranks of CP2 (every token once) and a middle rank of CP4 (a finer subset: runs of
    its queries in each document); the other CP4 ranks repeat the same launches (ADR 0038)."""
    return [(2, 0), (2, 1), (4, 1)]


def _same(x, ref, exact: bool, tol: float = 5e-3) -> bool:
    x, ref = x.cpu(), ref.cpu()
    return torch.equal(x, ref) if exact else rel_err(x.float(), ref.float()) < tol


def _inputs(msa, hq, hkv, d, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    t = msa.num_tokens
    q, k, v, dout = (torch.randn((t, h, d), generator=gen).to(torch.bfloat16)
                     for h in (hq, hkv, hkv, hq))
    return q, k, v, dout, random_q2k(msa, hkv, top_k, BS, gen)


def test_load_balanced_helper_covers_every_token_once():
    msa = make_layout(ROWS, SEQ, BS)
    for cp in (2, 4):
        parts = [local_queries(msa, cp, r) for r in range(cp)]
        assert all(bool((p[1:] > p[:-1]).all()) for p in parts)
        assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(msa.num_tokens))


@pytest.mark.parametrize("bm", [16, 8])
def test_subset_selection_equals_full_rows(set_launch, bm):
    set_launch({"sel.bm": bm})
    msa_h = make_layout(ROWS, SEQ, BS)
    msa = layout_on_kernel_device(msa_h)
    gen = torch.Generator().manual_seed(bm)
    iq = torch.randn((msa.num_tokens, 2, 16), generator=gen).to(torch.bfloat16)
    ik = torch.randn((msa.num_tokens, 16), generator=gen).to(torch.bfloat16)
    kw = dict(top_k=3, init_blocks=1, local_blocks=1)
    dq_, dk_ = iq.to(KERNEL_DEVICE), ik.to(KERNEL_DEVICE)
    ids = triton_select_blocks(dq_, dk_, msa, **kw)
    for cp, r in _ranks():
        rows = local_queries(msa_h, cp, r)
        dev_rows = rows.to(KERNEL_DEVICE)
        sub = triton_select_blocks(dq_[dev_rows], dk_, msa, queries=dev_rows, **kw)
        assert torch.equal(sub, ids[:, dev_rows]), (cp, r)
        ref = select_rows_f64(iq, ik, msa_h, rows, block_size=BS, **kw)
        assert torch.equal(sub.cpu(), ref), (cp, r)


# Under the interpreter the mixed schedule runs the union programs the union-only one would;
# compiled on a GPU every schedule runs (ADR 0038).
@pytest.mark.parametrize("schedule", [
    pytest.param(name, marks=pytest.mark.skipif(
        INTERPRET and name == "union",
        reason="the [mixed] case runs the union programs under the interpreter"))
    for name in sorted(SCHEDULES)])
def test_subset_attention_equals_full_rows(set_launch, schedule):
    set_launch(SCHEDULES[schedule])
    # Compiled, only the per-token programs are certain to repeat the full run's operations
    # for a row (a union tile's list holds the local queries' blocks only).
    exact = schedule == "per_token" or INTERPRET
    hq, hkv, d = 4, 2, 16
    msa_h = make_layout(ROWS, SEQ, BS)
    msa = layout_on_kernel_device(msa_h)
    q, k, v, dout, q2k = _inputs(msa_h, hq, hkv, d, 3, seed=len(schedule))
    scale = 1.0 / math.sqrt(d)
    dq_, dk_, dv_, ddo, dq2k = (x.to(KERNEL_DEVICE) for x in (q, k, v, dout, q2k))
    # Every backward takes its forward's union lists, as the backend passes them (building
    # them is most of the interpreter's time here); test_subset_dq_reuses_the_forward_unions
    # shows a subset dq that builds its own gives the same bits.
    out, lse, unions, mass = triton_attention_forward(dq_, dk_, dv_, dq2k, msa, scale,
                                                      return_unions=True,
                                                      return_block_mass=True)
    gq, _, _ = triton_attention_backward(ddo, dq_, dk_, dv_, out, lse, dq2k, msa, scale,
                                         unions=unions)
    for cp, r in _ranks():
        rows = local_queries(msa_h, cp, r)
        lr = rows.to(KERNEL_DEVICE)
        sq, sq2k = dq_[lr], dq2k[:, lr].contiguous()
        o2, l2, u2, m2 = triton_attention_forward(sq, dk_, dv_, sq2k, msa, scale,
                                                  return_unions=True, return_block_mass=True,
                                                  queries=lr)
        assert _same(o2, out[lr], exact) and _same(m2, mass[:, lr], exact), (cp, r)
        assert _same(l2, lse[:, lr], exact, 1e-5), (cp, r)
        g2 = triton_attention_backward(ddo[lr], sq, dk_, dv_, o2, l2, sq2k, msa, scale,
                                       unions=u2, queries=lr)
        assert _same(g2[0], gq[lr], exact), (cp, r)
        local = torch.zeros(msa.num_tokens, dtype=torch.bool, device=KERNEL_DEVICE)
        local[lr] = True
        masked = torch.where(local[:, None, None], ddo, 0)
        assert g2[1].shape == k.shape and g2[2].shape == v.shape
        # dk / dv against the full launch with the other queries' dout zeroed: the dk/dv
        # kernel is the same under every schedule (only the forward and dq differ), so the
        # mixed schedule, whose dq writes delta from union and per-token programs, runs it
        # (under the interpreter the per-token case repeated the same dk/dv programs); the
        # float64 oracle below checks every schedule's dk / dv.
        if schedule == "mixed" or not INTERPRET:
            _, dk0, dv0 = triton_attention_backward(masked, dq_, dk_, dv_, out, lse, dq2k,
                                                    msa, scale, unions=unions)
            # The KV-outer kernel groups a key block's query list in tiles; the subset's
            # lists lack the other queries, so the fp32 sums group differently (not bitwise).
            assert _same(g2[1], dk0, False) and _same(g2[2], dv0, False), (cp, r)
        # float64 oracles of the subset rows and of the local queries' dk / dv.
        ro, rl, rdq = attention_rows_f64(q, k, v, dout, q2k, msa_h, rows, scale, BS)
        assert rel_err(o2.cpu(), ro) < TOL and rel_err(g2[0].cpu(), rdq) < TOL
        fin = torch.isfinite(rl)
        assert rel_err(l2.cpu()[fin], rl[fin]) < 1e-4
        *_, rdk, rdv = attention_grads_f64(q, k, v, q2k, msa_h, scale, BS, masked.cpu())
        assert rel_err(g2[1].cpu(), rdk) < TOL and rel_err(g2[2].cpu(), rdv) < TOL


def test_subset_dq_reuses_the_forward_unions(set_launch):
    set_launch(SCHEDULES["union"])
    msa_h = make_layout(ROWS, SEQ, BS)
    msa = layout_on_kernel_device(msa_h)
    q, k, v, dout, q2k = (x.to(KERNEL_DEVICE) for x in _inputs(msa_h, 4, 2, 16, 2, seed=9))
    rows = local_queries(msa_h, 2, 1).to(KERNEL_DEVICE)
    sq, sq2k = q[rows], q2k[:, rows].contiguous()
    out, lse, unions = triton_attention_forward(sq, k, v, sq2k, msa, return_unions=True,
                                                queries=rows)
    subset = query_subset(msa, BS, rows)
    assert unions.count.shape[1] == subset.tile_list(unions.qt).numel()
    a = triton_attention_backward(dout[rows], sq, k, v, out, lse, sq2k, msa, unions=unions,
                                  queries=rows)
    b = triton_attention_backward(dout[rows], sq, k, v, out, lse, sq2k, msa, queries=rows)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _dense_layout():
    ids = document_map_from_lengths(ROWS, SEQ, KERNEL_DEVICE)
    return MSAMicrobatch.from_document_map(ids, block_size=BS)


def test_subset_dense_loss_adds_up_to_the_full_loss():
    msa = _dense_layout()
    t, heads, group, d = msa.num_tokens, 2, 2, 16
    gen = torch.Generator().manual_seed(4)
    iq, ik, q, k = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in
                    ((t, heads, d), (t, d), (t, heads * group, d), (t, heads, d)))
    q2k = random_q2k(make_layout(ROWS, SEQ, BS), heads, 2, BS, gen)

    def run(rows=None, f64=False):
        sel = (lambda x: x) if rows is None else (lambda x: x[rows])
        dev = "cpu" if f64 else KERNEL_DEVICE
        cast = (lambda x: x.double()) if f64 else (lambda x: x)
        a = cast(sel(iq)).to(dev).detach().clone().requires_grad_(True)
        b = cast(ik).to(dev).detach().clone().requires_grad_(True)
        sq2k = (q2k if rows is None else q2k[:, rows].contiguous()).to(dev)
        kw = dict(softmax_scale=0.3, num_index_heads_total=heads, loss_coeff=0.5, q2k=sq2k)
        if f64:
            loss, stats = compute_indexer_loss(a, b, cast(q), cast(k), _host_layout(),
                                               score_type="max", **kw)
        else:
            dr = None if rows is None else rows.to(dev)
            loss, stats = dense_indexer_loss_triton(a, b, sel(q).to(dev), k.to(dev), msa,
                                                    queries=dr, **kw)
        loss.backward()
        return loss.detach().cpu(), stats, a.grad.cpu(), b.grad.cpu()

    loss, stats, gq, gk = run()
    ref, _, rgq, rgk = run(f64=True)
    for cp in (2, 4):
        total, gks, recall = 0.0, torch.zeros(gk.shape, dtype=torch.float64), 0.0
        gqs = torch.zeros_like(gq)
        for r in range(cp):
            rows = local_queries(msa, cp, r)
            l2, st2, gq2, gk2 = run(rows)
            assert gk2.shape == ik.shape
            assert torch.equal(gq2, gq[rows]), (cp, r)  # the same per-token kernel rows
            gqs[rows] = gq2
            assert float(st2["recall_count"]) == rows.numel() * heads
            total, gks = total + float(l2), gks + gk2.double()
            recall += float(st2["recall_mass"])
        assert abs(total - float(loss)) <= 1e-5 * abs(float(loss))
        assert abs(total - float(ref)) <= 1e-4 * abs(float(ref))
        # Some ranks' rows see one candidate block only (zero gradient): compare all ranks.
        assert rel_err(gqs, rgq) < TOL
        assert rel_err(gks, gk) < TOL and rel_err(gks, rgk) < TOL
        assert abs(recall - float(stats["recall_mass"])) <= 1e-5 * float(stats["recall_mass"])


def _host_layout():
    return MSAMicrobatch.from_document_map(document_map_from_lengths(ROWS, SEQ), block_size=BS)


def test_subset_is_memoized_per_layout_and_queries_tensor():
    msa = _dense_layout()
    rows = local_queries(msa, 2, 0).to(KERNEL_DEVICE)
    first = query_subset(msa, BS, rows)
    assert query_subset(msa, BS, rows) is first
    assert query_subset(msa, BS, rows.clone()) is not first
    assert query_subset(msa, BS, None) is None
    # Tile lists: ascending full-launch tile ids, each holding a local query.
    for qt, tiles in first.tiles.items():
        ids = tiles.long().cpu()
        assert bool((ids[1:] > ids[:-1]).all())
        view = msa.kernel_layout(BS)
        pos = view.token_pos.long()[rows.cpu()]
        want = (view.token_first_block[rows.cpu()] + pos // BS) * (BS // qt) + (pos % BS) // qt
        assert torch.equal(ids, torch.unique(want.cpu()))


def test_subset_refuses_bad_queries():
    msa = _dense_layout()
    t = msa.num_tokens
    q = torch.zeros(4, 2, 16, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    k = torch.zeros(t, 16, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    kw = dict(top_k=2, init_blocks=0, local_blocks=1)
    cases = [
        (torch.tensor([3, 1, 5, 6]), "strictly ascending"),
        (torch.tensor([0, 1, 2, t]), "outside"),
        (torch.tensor([0, 1, 2, 3], dtype=torch.int32), "int64"),
        (torch.tensor([0, 1, 2]), "queries holds 3"),
    ]
    for rows, match in cases:
        with pytest.raises(ValueError, match=match):
            triton_select_blocks(q, k, msa, queries=rows.to(KERNEL_DEVICE), **kw)
    with pytest.raises(ValueError, match=r"index_k must be \[T="):
        triton_select_blocks(q, k[:8], msa, queries=torch.arange(4, device=KERNEL_DEVICE), **kw)


def test_empty_subset_and_backend_passes_queries():
    msa_h = make_layout(ROWS, SEQ, BS)
    msa = layout_on_kernel_device(msa_h)
    q, k, v, dout, q2k = (x.to(KERNEL_DEVICE) for x in _inputs(msa_h, 2, 1, 16, 2, seed=2))
    none = torch.zeros(0, dtype=torch.int64, device=KERNEL_DEVICE)
    out, lse = triton_attention_forward(q[none], k, v, q2k[:, none], msa, queries=none)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    _, dk, dv = triton_attention_backward(dout[none], q[none], k, v, out, lse, q2k[:, none],
                                          msa, queries=none)
    assert dk.shape == k.shape and not dk.any() and not dv.any()
    rows = local_queries(msa_h, 4, 3).to(KERNEL_DEVICE)
    iq = q[:, :1].contiguous()
    ik = k[:, 0].contiguous()
    kw = dict(top_k=2, init_blocks=0, local_blocks=1)
    view = QueryView(msa, rows)
    assert torch.equal(BACKEND.select_blocks(iq[rows], ik, view, **kw),
                       triton_select_blocks(iq, ik, msa, **kw)[:, rows])
    selection = Selection(q2k[:, rows].contiguous(), msa.block_size, canonical=True)
    fwd = BACKEND.attention_forward(q[rows], k, v, selection, view, 0.25)
    assert selection.unions is not None  # the forward's union lists, for the backward
    bwd = BACKEND.attention_backward(dout[rows], q[rows], k, v, fwd[0], fwd[1], selection,
                                     view, 0.25)
    full = triton_attention_forward(q, k, v, q2k, msa, 0.25)
    assert torch.equal(fwd[0], full[0][rows]) and bwd[1].shape == k.shape


# ----------------------------------------------------------------------------- H200 sizes


@pytest.mark.gpu
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_subset_matches_full_rows_on_gpu_default_launch(cp):
    """Production-like shapes (d = 128, block 128, G = 16) with the default launch: selection
    bitwise, attention, block mass and dq rows, dk / dv, per rank of a load-balanced split."""
    rows_docs = [[3000, 900, 100, 60], [4096]]  # padding at the end of row 0
    seq, bs, hq, hkv, d, top_k = 4096, 128, 16, 1, 128, 8
    ids = document_map_from_lengths(rows_docs, seq, "cuda")
    msa = MSAMicrobatch.from_document_map(ids, block_size=bs)
    t = msa.num_tokens
    gen = torch.Generator(device="cuda").manual_seed(cp)
    iq = torch.randn(t, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
    ik = torch.randn(t, d, device="cuda", generator=gen).to(torch.bfloat16)
    q = torch.randn(t, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(t, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    dout = torch.randn(t, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    kw = dict(top_k=top_k, init_blocks=1, local_blocks=2)
    sel = triton_select_blocks(iq, ik, msa, **kw)
    out, lse, mass = triton_attention_forward(q, k, v, sel, msa, return_block_mass=True)
    gq, _, _ = triton_attention_backward(dout, q, k, v, out, lse, sel, msa)
    for r in range(cp):
        lr = local_queries(msa, cp, r).cuda()
        s2 = triton_select_blocks(iq[lr], ik, msa, queries=lr, **kw)
        assert torch.equal(s2, sel[:, lr])
        o2, l2, m2 = triton_attention_forward(q[lr], k, v, s2, msa, return_block_mass=True,
                                              queries=lr)
        assert rel_err(o2, out[lr]) < 2e-3 and rel_err(m2, mass[:, lr]) < 1e-4
        assert rel_err(l2, lse[:, lr]) < 1e-5
        g2 = triton_attention_backward(dout[lr], q[lr], k, v, o2, l2, s2, msa, queries=lr)
        assert rel_err(g2[0], gq[lr]) < 5e-3
        local = torch.zeros(t, dtype=torch.bool, device="cuda")
        local[lr] = True
        masked = torch.where(local[:, None, None], dout, 0)
        _, dk0, dv0 = triton_attention_backward(masked, q, k, v, out, lse, sel, msa)
        assert rel_err(g2[1], dk0) < 5e-3 and rel_err(g2[2], dv0) < 5e-3


def test_byproduct_loss_takes_subset_rows_with_global_keys():
    """The sparse loss from by-products with a subset's rows: the argmax keys are global rows,
    so d index_k has index_k's T rows; every rank divides by the global T * H, so the ranks'
    gradients add up to the full run's."""
    from nemo_msa.indexer_loss import sparse_indexer_loss_from_byproducts

    msa = make_layout(ROWS, SEQ, BS)
    t, heads, d, top_k = msa.num_tokens, 2, 8, 3
    gen = torch.Generator().manual_seed(7)
    iq = torch.randn(t, heads, d, generator=gen, dtype=torch.float64)
    ik = torch.randn(t, d, generator=gen, dtype=torch.float64)
    q2k = random_q2k(msa, heads, top_k, BS, gen)
    mass = torch.softmax(torch.randn(heads, t, top_k, generator=gen, dtype=torch.float64), -1)

    def grads(rows, queries):
        a = iq[rows].clone().requires_grad_(True)
        b = ik.clone().requires_grad_(True)
        loss, _ = sparse_indexer_loss_from_byproducts(
            a, b, q2k[:, rows], mass[:, rows], msa, num_index_heads_total=heads,
            loss_coeff=1.0, queries=queries)
        loss.backward()
        return a.grad, b.grad

    gq, gk = grads(torch.arange(t), None)
    rows = [local_queries(msa, 2, r) for r in range(2)]
    parts = [grads(r, r) for r in rows]
    assert all(p[1].shape == ik.shape for p in parts)
    total = sum(p[1] for p in parts)
    assert torch.allclose(total, gk, rtol=1e-10, atol=1e-12)
    for (dq, _), r in zip(parts, rows, strict=True):
        assert torch.allclose(dq, gq[r], rtol=1e-10, atol=1e-12)
