"""Triton sparse attention forward/backward vs float64 dense masked attention.

The kernels run under the interpreter on CPU-only machines and compiled on a CUDA GPU; the
inputs and float64 references are the same host tensors either way.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from _msa_support import layout_on_kernel_device, make_layout, on_kernel_device, random_q2k

import nemo_msa.attention.triton_union as tu
from nemo_msa import unplanned
from nemo_msa.attention.triton_bwd import triton_attention_backward
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.testing.oracle import attention_grads_f64, rel_err, tile_unions_reference
from nemo_msa.triton.kernel_layout import INTERPRET, kernel_layout
from nemo_msa.triton.launch import ForwardLaunch

TOL = 1e-2  # bf16 operands: MSA_SPEC.md's bound on ||x - ref|| / ||ref||


def _run_case(rows, seq_len, bs, hq, hkv, d, top_k, seed, drop_own=False, repeat=False,
              reuse_unions=False):
    """Forward and backward against float64; ``repeat`` also asks a bitwise-equal second
    backward (the backward has no atomics); ``reuse_unions`` hands the forward's union lists
    to the backward (as the backend does) instead of letting dq build its own."""
    _run_case_with_config(rows, seq_len, bs, hq, hkv, d, top_k, seed, drop_own, repeat,
                          reuse_unions)


def _run_case_with_config(rows, seq_len, bs, hq, hkv, d, top_k, seed, drop_own, repeat,
                          reuse_unions=False):
    gen = torch.Generator().manual_seed(seed)
    msa = make_layout(rows, seq_len, bs)
    t = msa.num_tokens
    q = torch.randn((t, hq, d), generator=gen).to(torch.bfloat16)
    k = torch.randn((t, hkv, d), generator=gen).to(torch.bfloat16)
    v = torch.randn((t, hkv, d), generator=gen).to(torch.bfloat16)
    dout = torch.randn((t, hq, d), generator=gen).to(torch.bfloat16)
    q2k = random_q2k(msa, hkv, top_k, bs, gen, drop_own=drop_own)
    scale = 1.0 / math.sqrt(d)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_grads_f64(
        q, k, v, q2k, msa, scale, bs, dout)
    dmsa = layout_on_kernel_device(msa)
    dev = on_kernel_device(q, k, v, q2k, dout)
    out, lse, unions = triton_attention_forward(*dev[:4], dmsa, scale, block_size=bs,
                                                return_unions=True)
    unions = unions if reuse_unions else None
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (hq, t)
    assert rel_err(out, ref_out) < TOL
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "lse must be -inf exactly where no key is seen"
    assert rel_err(lse[fin], ref_lse[fin]) < 1e-4
    assert (out[~fin.t()] == 0).all()
    grads = triton_attention_backward(dev[4], *dev[:3], *on_kernel_device(out, lse), dev[3],
                                      dmsa, scale, block_size=bs, unions=unions)
    dq, dk, dv = (g.cpu() for g in grads)
    for name, x, ref in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert x.dtype == torch.bfloat16
        err = rel_err(x, ref)
        assert err < TOL, f"{name} rel err {err:.2e}"
    if not repeat:
        return
    # Deterministic: a second backward is bitwise identical.
    grads2 = triton_attention_backward(dev[4], *dev[:3], *on_kernel_device(out, lse), dev[3],
                                       dmsa, scale, block_size=bs, unions=unions)
    assert all(torch.equal(a, b.cpu()) for a, b in zip((dq, dk, dv), grads2, strict=True))


@pytest.mark.parametrize(
    "rows,seq_len,bs,hq,hkv,d,top_k,drop_own",
    [
        # Packed docs incl. length 1 and exact multiples of the block size, padded rows.
        ([[1, 32, 21], [16, 3]], 60, 16, 4, 2, 16, 3, False),
        # GQA ratio 16 (production topology ratio), several blocks, -1 rows and no own block.
        ([[70, 9]], 80, 16, 16, 1, 32, 3, True),
        # Block size 32, head dim 64, G = 2 padded to 16 rows.
        ([[64, 31]], 100, 32, 2, 1, 64, 2, False),
    ],
)
def test_attention_matches_reference(set_launch, rows, seq_len, bs, hq, hkv, d, top_k,
                                     drop_own):
    # The per-token forward and dq alone; the union/hybrid paths have their own tests below.
    set_launch({"fwd.union_qt": 0})
    set_launch({"bwd.dq_union_qt": 0})
    _run_case(rows, seq_len, bs, hq, hkv, d, top_k, seed=seq_len * 31 + d, drop_own=drop_own,
              repeat=hq // hkv == 16)


def test_attention_rejects_bad_inputs():
    msa = make_layout([[16]], 16, 16)
    q = torch.zeros((16, 2, 16), dtype=torch.bfloat16)
    k = torch.zeros((16, 1, 16), dtype=torch.bfloat16)
    q2k = torch.zeros((1, 16, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be bf16"):
        triton_attention_forward(q.float(), k, k, q2k, msa, block_size=16)
    with pytest.raises(ValueError, match="q2k must be int32"):
        triton_attention_forward(q, k, k, q2k.long(), msa, block_size=16)
    with pytest.raises(ValueError, match="q is on meta: expected a (cpu|cuda) tensor"):
        triton_attention_forward(q.to("meta"), k, k, q2k, msa, block_size=16)
    with pytest.raises(ValueError, match="Hq=2 must be a multiple of KV heads Hkv=3"):
        k3 = torch.zeros((16, 3, 16), dtype=torch.bfloat16)
        triton_attention_forward(q, k3, k3, q2k, msa, block_size=16)


@pytest.mark.parametrize("qt,max_count", [(2, 1000), (4, 1000), (4, 3), (8, 2)])
def test_union_forward_and_dq_match_reference(set_launch, qt, max_count):
    """The query-tile union forward and dq alone (max_count 1000), and the hybrids (tiles with
    more than ``max_count`` union blocks go to the per-token kernels), against float64; dq
    builds its own union lists. No second backward: test_dq_reuses_the_forward_union_lists
    runs a hybrid backward (union and per-token dq, dk/dv) twice and asks the same bits."""
    set_launch({"fwd.union_qt": qt})
    set_launch({"fwd.union_max": max_count})
    set_launch({"bwd.dq_union_qt": qt})
    set_launch({"bwd.dq_union_max": max_count})
    # G = 4 (padded to 16 rows) at bs 16, and G = 16 with tiles that straddle a document end.
    rows, seq_len, hq, hkv = ([[1, 37], [18, 3]], 40, 8, 2) if qt < 8 else ([[45, 30]], 80, 16, 1)
    _run_case(rows, seq_len, 16, hq, hkv, 16, 2, seed=13 + qt, drop_own=True)


def test_dq_reuses_the_forward_union_lists(monkeypatch, set_launch):
    """With the forward's unions the backward builds no union lists and gives bitwise the
    gradients it gives when it builds its own; unions of another (or changed) q2k are refused,
    and unions for another tile size are not used."""
    set_launch({"bwd.dq_union_max": 3})  # a hybrid: union and per-token tiles
    gen = torch.Generator().manual_seed(31)
    msa = make_layout([[45, 30]], 80, 16)
    t = msa.num_tokens
    q, dout = (torch.randn((t, 16, 16), generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn((t, 1, 16), generator=gen).to(torch.bfloat16) for _ in range(2))
    q2k = random_q2k(msa, 1, 2, 16, gen, drop_own=True)
    dmsa = layout_on_kernel_device(msa)
    q, k, v, q2k, dout = on_kernel_device(q, k, v, q2k, dout)
    out, lse, unions = triton_attention_forward(q, k, v, q2k, dmsa, 0.25, return_unions=True)
    assert unions is not None and unions.qt == 8
    builds = []
    build = tu.tile_unions
    monkeypatch.setattr(tu, "tile_unions", lambda *a, **kw: builds.append(1) or build(*a, **kw))
    args = (dout, q, k, v, out, lse, q2k, dmsa, 0.25)
    unplanned.reset()
    reused = triton_attention_backward(*args, unions=unions)
    assert builds == []
    built = triton_attention_backward(*args, dkdv="triton")
    assert builds == [1]
    # Without a plan's dkdv the kernel was chosen per call, and counted; with it, not.
    assert unplanned.counts() == {"dkdv": 1}
    with pytest.raises(ValueError, match="MSAKernels.dkdv='gluon' but this call has"):
        triton_attention_backward(*args, dkdv="gluon")  # no SM90 GPU: refused, not replaced
    assert all(torch.equal(a, b) for a, b in zip(reused, built, strict=True))
    set_launch({"bwd.dq_union_qt": 4})  # another tile size: dq builds its own
    triton_attention_backward(*args, unions=unions)
    assert builds == [1, 1]
    with pytest.raises(ValueError, match="unions were built from another q2k"):
        triton_attention_backward(*args[:6], q2k.clone(), *args[7:], unions=unions)
    q2k[0, 0, 0] = q2k[0, 0, 0]  # an in-place write bumps the version
    with pytest.raises(ValueError, match="unions were built from another q2k"):
        triton_attention_backward(*args, unions=unions)


def test_union_pointer_loads_match_reference(set_launch):
    """The union kernels with the whole blocks read by pointer loads (the path of GPUs without
    TMA; the default, by TMA, runs in the test above); dq takes the forward's union lists
    (their build is not what this test is about)."""
    for prefix in ("fwd.union_", "bwd.dq_union_"):
        set_launch({prefix + "qt": 4, prefix + "max": 1000, prefix + "tma": False})
    _run_case([[75, 1], [40]], 80, 16, 8, 2, 16, 3, seed=5, drop_own=True, reuse_unions=True)


# The interpreter ignores the cap, so there both cases are the uncapped union forward (TMA,
# qt 4, max 1000) of test_union_forward_and_dq_match_reference[4-1000]: they run compiled only.
@pytest.mark.skipif(INTERPRET, reason="the interpreter ignores the register cap: the union "
                    "forward it would run is test_union_forward_and_dq_match_reference[4-1000]")
@pytest.mark.parametrize("maxnreg", [None, 128])
def test_union_forward_register_cap_matches_reference(set_launch, maxnreg):
    """The union forward without and with its register cap (on a GPU the cap spills, which
    must not change the result), against float64."""
    set_launch({"fwd.union_qt": 4})
    set_launch({"fwd.union_max": 1000})
    set_launch({"fwd.union_maxnreg": maxnreg})
    _run_case([[75, 1], [40]], 80, 16, 8, 2, 16, 3, seed=21, drop_own=True)


def test_union_register_cap_only_with_the_own_block_by_tma():
    """The union kernel's register cap applies only where the own block is read by TMA: with
    pointer-loaded own-block tiles (no TMA on the GPU, or union_own_tma off) it would spill
    their addresses."""
    import nemo_msa.attention.triton_fwd as tf

    assert tf.union_register_cap(128, True) == 128
    assert tf.union_register_cap(128, False) is None


def test_union_flat_loop_and_own_block_by_tma_match_reference(set_launch):
    """The union forward's flat whole-block loop (one 64-key tile per step, d = 128 and block
    128 so that a block is two tiles) with its own block read by pointer loads and by TMA, and
    the union dq (which ``fwd.union_own_tma`` does not touch: run once, on the forward's union
    lists), against float64. The documents end inside a block, the next document starts with
    infinite K and V rows (a zero probability or dS must not meet them), and some rows select a
    block past their own (it holds no visible key and must contribute nothing)."""
    set_launch({"fwd.union_max": 1000, "bwd.dq_union_max": 1000})
    bs, hq, hkv, d, top_k = 128, 16, 1, 128, 3
    gen = torch.Generator().manual_seed(31)
    msa = make_layout([[200, 60], [140]], 300, bs)
    t = msa.num_tokens
    q, k, v, dout = (torch.randn((t, h, d), generator=gen).to(torch.bfloat16)
                     for h in (hq, hkv, hkv, hq))
    k[200] = float("inf")  # the first token of document 2, right after document 1's block 1
    v[200] = float("inf")
    q2k = random_q2k(msa, hkv, top_k, bs, gen, drop_own=True)
    pos = msa.document_positions
    past_own = (pos < bs) & (torch.arange(t) % 3 == 0)
    q2k[0, past_own, top_k - 1] = 1  # block 1: past the own block 0 of these rows
    scale = 1.0 / math.sqrt(d)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_grads_f64(q, k, v, q2k, msa, scale,
                                                                   bs, dout)
    # The rows that never see the inf rows: documents 1 and 3 (document 2 sees its own).
    clean = torch.isfinite(ref_out).flatten(1).all(1) & torch.isfinite(ref_dq).flatten(1).all(1)
    assert clean[:200].all() and clean[260:].all() and not clean[200:260].all()
    fin = torch.isfinite(ref_lse) & clean[None, :]
    dev = on_kernel_device(q, k, v, q2k, dout)
    dmsa = layout_on_kernel_device(msa)
    for own_tma in (False, True):
        set_launch({"fwd.union_own_tma": own_tma})
        out, lse, unions = triton_attention_forward(*dev[:4], dmsa, scale, block_size=bs,
                                                    return_unions=True)
        host_out, host_lse = out.cpu(), lse.cpu()
        assert rel_err(host_out[clean], ref_out[clean]) < TOL, own_tma
        assert rel_err(host_lse[fin], ref_lse[fin]) < 1e-4, own_tma
    dq, dk, dv = (x.cpu() for x in triton_attention_backward(
        dev[4], *dev[:3], out, lse, dev[3], dmsa, scale, block_size=bs, unions=unions))
    assert rel_err(dq[clean], ref_dq[clean]) < TOL
    # The keys of documents 1 and 3: only their (clean) rows attend them.
    keys = torch.ones(t, dtype=torch.bool)
    keys[200:260] = False
    assert rel_err(dk[keys], ref_dk[keys]) < TOL and rel_err(dv[keys], ref_dv[keys]) < TOL


@pytest.mark.parametrize("tiles,build_tiles", [(1, 1), (3, 4)])
def test_per_token_grids_match_reference(set_launch, tiles, build_tiles):
    """The hybrid's variants together against float64: the per-token kernels' grid with one
    union tile per program doing the tokens the union kernel left, or 3 (a count that leaves
    the last program short), with union builds of one and of four tiles per program, on a mix
    (max_count 2) of union tiles, which the per-token programs skip, and per-token tiles.
    Every tile to the union kernel (per-token programs that skip every tile) is
    test_union_forward_and_dq_match_reference's max_count 1000, dq's grid 8 tiles a program."""
    for prefix in ("fwd.", "bwd.dq_"):
        set_launch({prefix + "tile_grid_tiles": tiles, prefix + "union_qt": 4,
                    prefix + "union_max": 2, prefix + "union_build_tiles": build_tiles})
    _run_case([[37, 1], [18, 3]], 40, 16, 8, 2, 16, 3, seed=17, drop_own=True)


def test_union_build_programs_write_only_their_tiles():
    """With several tiles per program the last program's surplus tiles write nothing: the
    lists and counts sit in larger buffers whose tails must keep their sentinel (the
    production width, 8 tokens x top-16 = 128 entries per tile, on 22 tiles: 3 programs)."""
    msa = make_layout([[130, 20]], 160, 16)
    q2k = random_q2k(msa, 1, 16, 16, torch.Generator().manual_seed(5))
    want, want_count = tile_unions_reference(q2k, kernel_layout(msa, 16), 8)
    tiles = want.shape[1]
    assert tiles % 8 != 0
    view = kernel_layout(layout_on_kernel_device(msa), 16)
    union, count = on_kernel_device(torch.full((1, tiles + 8, 128), -7, dtype=torch.int32),
                                    torch.full((tiles + 8,), -7, dtype=torch.int32))
    dq2k = on_kernel_device(q2k)
    tu._tile_union_kernel[(-(-tiles // 8), 1)](
        q2k_ptr=dq2k, union_ptr=union, count_ptr=count, cu_ptr=view.cu_seqlens,
        block_doc_ptr=view.block_doc, block_local_ptr=view.block_local,
        stride_sg=dq2k.stride(0), stride_st=dq2k.stride(1), stride_ug=union.stride(0),
        stride_ut=union.stride(1), num_tiles=tiles, tiles_ptr=view.cu_seqlens,
        qrow_ptr=view.cu_seqlens, TOPK=16, QT=8, BS=16, WIDTH=128, W=128, TP=8, SUBSET=False)
    union, count = union.cpu(), count.cpu()
    assert torch.equal(union[:, :tiles], want) and torch.equal(count[:tiles], want_count[0])
    assert (union[:, tiles:] == -7).all() and (count[tiles:] == -7).all()


@pytest.mark.parametrize(("key", "value", "match"), [
    ("fwd.union_build_tiles", 3, "fwd.union_build_tiles=3: expected a power of two"),
    ("bwd.dq_union_build_warps", 16, "bwd.dq_union_build_warps=16: expected 1, 2, 4 or 8"),
    ("fwd.tile_grid_tiles", 0, "fwd.tile_grid_tiles=0: expected an int in 1..64"),
    ("bwd.dq_tile_grid_tiles", 65, "bwd.dq_tile_grid_tiles=65: expected an int in 1..64"),
    ("fwd.tile_grid_tiles", 2.0, "fwd.tile_grid_tiles=2.0: expected int"),
    ("fwd.union_tma", 1, "fwd.union_tma=1: expected bool"),
    ("fwd.union_maxnreg", "128", "fwd.union_maxnreg='128': expected int or None"),
    ("bwd.kv_kernel", "cuda", "bwd.kv_kernel='cuda': expected 'triton' or 'gluon'"),
    # Gone: a backward that skipped dq also skipped delta, which dk/dv read (wrong dk).
    ("bwd.skip", "dq", "unknown launch parameter 'bwd.skip'"),
    ("fwd.union_flat", False, "unknown launch parameter 'fwd.union_flat'"),
    ("fwd.union_build", "torch", "unknown launch parameter 'fwd.union_build'"),
    ("attn.union_max", 1, "unknown launch parameter 'attn.union_max'"),
])
def test_launch_settings_are_validated(key, value, match):
    """A bad launch setting is named with its value before anything launches."""
    from nemo_msa.triton.launch import launch_overrides

    with pytest.raises(ValueError, match=re.escape(match)):
        with launch_overrides({key: value}):
            pass


def test_launch_overrides_restore_the_defaults_and_launchers_take_instances():
    from nemo_msa.triton.launch import current_launch, launch_overrides

    with launch_overrides({"fwd.union_max": 48}, fwd=ForwardLaunch(union_qt=4)) as launches:
        assert launches["fwd"] == ForwardLaunch(union_qt=4, union_max=48)
        assert current_launch("fwd") == launches["fwd"]
        with launch_overrides({"bwd.kv_warps": 8}):
            assert current_launch("fwd").union_max == 48 and current_launch("bwd").kv_warps == 8
        assert current_launch("bwd").kv_warps == 4
    assert current_launch("fwd") == ForwardLaunch()
    msa = make_layout([[20]], 20, 16)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn((20, 2, 16), generator=gen).to(torch.bfloat16)
    k = torch.randn((20, 1, 16), generator=gen).to(torch.bfloat16)
    q2k = random_q2k(msa, 1, 2, 16, gen)
    dev = on_kernel_device(q, k, k, q2k)
    dmsa = layout_on_kernel_device(msa)
    per_token = triton_attention_forward(*dev, dmsa, launch=ForwardLaunch(union_qt=0))
    union, lse, unions = triton_attention_forward(*dev, dmsa, return_unions=True,
                                                  launch=ForwardLaunch(union_max=1000))
    assert unions is not None and unions.qt == 8
    assert rel_err(union.cpu(), per_token[0].cpu()) < 1e-2


def test_kv_descriptors_only_for_unit_head_stride_and_aligned_rows():
    """TMA needs k/v viewable as [T, Hkv * d] with 16-byte aligned rows; anything else falls
    back to pointer loads (None) rather than reading the wrong rows."""
    from nemo_msa.triton.kernel_layout import INTERPRET
    from nemo_msa.triton.tiles import TensorDescriptor, kv_descriptors

    if TensorDescriptor is None:
        pytest.skip("this Triton has no host TensorDescriptor (the kernels use pointer loads)")
    k, v = on_kernel_device(torch.zeros((10, 2, 16), dtype=torch.bfloat16),
                            torch.zeros((10, 2, 16), dtype=torch.bfloat16))
    descs = kv_descriptors(k, v, 16, INTERPRET)
    if not INTERPRET and torch.cuda.get_device_capability(k.device)[0] < 9:
        assert descs is None
        return
    assert descs is not None and list(descs[0].shape) == [10, 32]
    assert list(descs[1].block_shape) == [16, 16]
    wide = on_kernel_device(torch.zeros((10, 2, 32), dtype=torch.bfloat16))
    assert kv_descriptors(wide[..., :16], v, 16, INTERPRET) is None  # head stride 32, not d
    flat = on_kernel_device(torch.zeros(10 * 32 + 1, dtype=torch.bfloat16))
    assert kv_descriptors(k, flat[1:].view(10, 2, 16), 16, INTERPRET) is None  # 2-byte offset
    odd = on_kernel_device(torch.zeros((10, 2, 20), dtype=torch.bfloat16))[..., :16]
    assert kv_descriptors(odd, v, 16, INTERPRET) is None


def test_tile_unions_by_kernel_equal_the_reference():
    """The Triton union build gives the torch reference's lists and counts (whole, and in
    chunks), and each count is the number of distinct selected blocks of the tile's tokens."""
    gen = torch.Generator().manual_seed(21)
    msa = make_layout([[1, 37, 60], [18, 3]], 100, 16)
    q2k = random_q2k(msa, 2, 3, 16, gen, drop_own=True)
    view = kernel_layout(msa, 16)
    whole, whole_count = tile_unions_reference(q2k, view, 4)
    union, count = tile_unions_reference(q2k, view, 4, chunk_tiles=3)
    assert torch.equal(union, whole) and torch.equal(count, whole_count)
    dview = kernel_layout(layout_on_kernel_device(msa), 16)
    # The production width too: 8 tokens x top-16 = 128 entries per tile.
    big = make_layout([[300, 20]], 320, 16)
    q2k16 = random_q2k(big, 1, 16, 16, gen)
    want = tile_unions_reference(q2k16, kernel_layout(big, 16), 8)
    dbig = kernel_layout(layout_on_kernel_device(big), 16)
    # Several tiles per program, with a tile count that is not a multiple of them (the last
    # program's surplus tiles must write nothing). The production width with 8 tiles per
    # program is test_union_build_programs_write_only_their_tiles (whose larger buffers also
    # show the surplus tiles write nothing).
    assert want[0].shape[1] % 8 != 0
    for tp, warps in ((1, 4), (8, 2)):
        by_kernel = tu.tile_unions(on_kernel_device(q2k), dview, 4, tiles_per_program=tp,
                                   warps=warps)
        assert torch.equal(by_kernel[0].cpu(), whole), tp
        assert torch.equal(by_kernel[1].cpu(), whole_count), tp
    got = tu.tile_unions(on_kernel_device(q2k16), dbig, 8, tiles_per_program=1, warps=4)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert int(want[1].max()) > 16  # the tiles' tokens disagree: real unions
    tok_tile = (view.token_first_block + view.token_pos // 16) * 4 + (view.token_pos % 16) // 4
    for g in range(2):
        for tile in torch.unique(tok_tile).tolist():
            toks = (tok_tile == tile).nonzero().flatten()
            want = sorted({b for b in q2k[g, toks].flatten().tolist() if b >= 0})
            n = int(count[g, tile])
            assert n == len(want) and union[g, tile, :n].tolist() == want
