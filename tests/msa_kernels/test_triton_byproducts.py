"""The indexer loss's by-products from the Triton kernels vs float64 references.

The sparse indexer loss's pass over the selected blocks: each slot's real block score (forced
blocks included) and the key attaining it.
Forward: each slot's attention mass, averaged over the group's query heads, on the union, the
per-token and the hybrid paths. The kernels run under the interpreter on CPU-only machines and
compiled on a CUDA GPU; inputs and references are the same host tensors either way.
"""

from __future__ import annotations

import math

import pytest
import torch
from _msa_support import layout_on_kernel_device, make_layout, on_kernel_device, random_q2k

from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.indexer_loss.triton_byproducts import block_scores_triton
from nemo_msa.selection.triton_select import triton_select_blocks
from nemo_msa.testing.oracle import block_scores_f64, doc_spans, rel_err, select_f64
from nemo_msa.triton.kernel_layout import INTERPRET


def block_mass_f64(q, k, q2k, msa, scale, block_size):
    """float64 [Hkv, T, top_k]: per slot the softmax mass of its block's visible keys (dense
    masked attention over the selected blocks), averaged over the group's query heads."""
    t, hq, _ = q.shape
    hkv, _, top_k = q2k.shape
    grp = hq // hkv
    out = torch.zeros(hkv, t, top_k, dtype=torch.float64)
    for s, e in doc_spans(msa):
        n = e - s
        keyblk = torch.arange(n) // block_size
        causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
        for g in range(hkv):
            sel = q2k[g, s:e].long()  # [n, K]
            inblock = sel[:, :, None] == keyblk[None, None, :]  # [n, K, n]
            visible = inblock.any(1) & causal
            qd = q[s:e, g * grp:(g + 1) * grp].double()  # [n, G, d]
            sc = torch.einsum("pgd,jd->gpj", qd, k[s:e, g].double()) * scale
            sc = sc.masked_fill(~visible[None], -math.inf)
            pr = torch.softmax(sc, -1).nan_to_num(0.0).mean(0)  # [n, n]
            out[g, s:e] = torch.einsum("pj,pkj->pk", pr, (inblock & causal[:, None, :]).double())
    return out


@pytest.mark.parametrize(
    "rows,seq_len,bs,d,top_k,init,local",
    [
        ([[1, 16, 33, 64, 5]], 128, 16, 16, 4, 0, 1),
        ([[40, 1], [16, 57], [80]], 100, 16, 32, 3, 1, 1),
        ([[150, 3], [97]], 160, 32, 16, 4, 0, 1),
    ],
)
def test_selected_block_scores_and_keys(rows, seq_len, bs, d, top_k, init, local):
    gen = torch.Generator().manual_seed(seq_len + bs + d)
    msa = make_layout(rows, seq_len, bs)
    t = msa.num_tokens
    q = torch.randn((t, 2, d), generator=gen).to(torch.bfloat16)
    k = torch.randn((t, d), generator=gen).to(torch.bfloat16)
    dmsa = layout_on_kernel_device(msa)
    dev_ids = triton_select_blocks(*on_kernel_device(q, k), dmsa, top_k=top_k, init_blocks=init,
                                   local_blocks=local, block_size=bs)
    scores, keys, _ = block_scores_triton(*on_kernel_device(q, k), dev_ids, dmsa)
    ids, scores, keys = dev_ids.cpu(), scores.cpu(), keys.cpu()
    ref_ids, _ = select_f64(q, k, msa, top_k=top_k, init_blocks=init, local_blocks=local,
                            block_size=bs)
    assert torch.equal(ids, ref_ids)
    assert scores.dtype == torch.float32 and keys.dtype == torch.int32
    ref_scores = block_scores_f64(q, k, msa, bs)
    docs = msa.token_documents.tolist()
    pos = msa.document_positions.tolist()
    cu = msa.cu_seqlens.tolist()
    unused = ids < 0
    assert bool((scores[unused] == -math.inf).all()) and bool((keys[unused] == -1).all())
    for h in range(2):
        for i in range(t):
            for s in range(top_k):
                b = int(ids[h, i, s])
                if b < 0:
                    continue
                want = float(ref_scores[docs[i]][h, pos[i], b])
                assert float(scores[h, i, s]) == pytest.approx(want, rel=1e-5, abs=1e-5)
                j = int(keys[h, i, s])
                local_j = j - cu[docs[i]]
                assert docs[j] == docs[i] and local_j // bs == b and local_j <= pos[i]
                attained = float(q[i, h].double() @ k[j].double())
                assert attained == pytest.approx(want, rel=1e-5, abs=1e-5)


# Under the interpreter the hybrid case runs the mass-writing code of both kernels (the union
# kernel's, and the per-token one's, shared by the per-token grid; it asserts both kinds of
# tiles); compiled on a GPU every schedule runs (ADR 0038).
@pytest.mark.parametrize("config", [
    pytest.param(config, id=name, marks=pytest.mark.skipif(
        INTERPRET and name != "hybrid",
        reason="the [hybrid] case runs this schedule's kernels under the interpreter"))
    for name, config in (("union", {}), ("per-token", {"union_qt": 0}),
                         ("hybrid", {"union_max": 3}))])
def test_forward_block_mass(set_launch, config):
    set_launch({f"fwd.{key}": value for key, value in config.items()})
    gen = torch.Generator().manual_seed(11)
    rows, seq_len, bs, hq, hkv, d, top_k = [[70, 5], [33, 64]], 128, 16, 4, 2, 32, 3
    msa = make_layout(rows, seq_len, bs)
    t = msa.num_tokens
    q = torch.randn((t, hq, d), generator=gen).to(torch.bfloat16)
    k = torch.randn((t, hkv, d), generator=gen).to(torch.bfloat16)
    v = torch.randn((t, hkv, d), generator=gen).to(torch.bfloat16)
    q2k = random_q2k(msa, hkv, top_k, bs, gen, drop_own=True)
    scale = 1.0 / math.sqrt(d)
    dev = on_kernel_device(q, k, v, q2k)
    out, lse, unions, mass = triton_attention_forward(*dev, layout_on_kernel_device(msa), scale,
                                                      block_size=bs, return_unions=True,
                                                      return_block_mass=True)
    if config.get("union_max"):  # the hybrid: union tiles and per-token ones
        used = unions.count[unions.count > 0]
        assert (used <= config["union_max"]).any() and (used > config["union_max"]).any()
    plain, plain_lse = triton_attention_forward(*dev, layout_on_kernel_device(msa), scale,
                                                block_size=bs)
    assert torch.equal(out.cpu(), plain.cpu()) and torch.equal(lse.cpu(), plain_lse.cpu())
    mass = mass.cpu()
    assert mass.dtype == torch.float32 and mass.shape == (hkv, t, top_k)
    want = block_mass_f64(q, k, q2k, msa, scale, bs)
    assert rel_err(mass, want) < 1e-2
    assert bool((mass[q2k < 0] == 0).all())
    # A token's slots hold its whole softmax: they sum to 1 unless it selected nothing visible.
    sums = mass.sum(-1)
    seen = want.sum(-1) > 0
    assert torch.allclose(sums[seen].double(), torch.ones(()).double(), atol=1e-2)
    assert bool((sums[~seen] == 0).all())
