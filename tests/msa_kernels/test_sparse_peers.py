"""benchmarks/bench_sparse_peers.py and benchmarks/msa_bench/sparse_formats.py /
sparse_peers.py (ADR 0056): an MSA selection in FlashAttention-4's block-sparse format (tile
lists, transposed lists, membership bitmask and its mask_mod's arithmetic) and in cuDNN-FE's
interval masks, expanded back to dense masks and compared with MSA's; the benchmark's case logic
with stand-in peers built from those formats; FA4's kernels compiled for sm_90a on the CPU (where
its wheels are given); on a GPU, the peers against our op."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from msa_bench import sparse_formats as sf
from msa_bench import sparse_peers as sp
from msa_bench.cases import make_case

from nemo_msa.attention.naive import document_causal_mask, selected_key_mask

ROOT = Path(__file__).resolve().parents[2]
BS = 16
pytestmark = pytest.mark.bench


def _cli():
    spec = importlib.util.spec_from_file_location(
        "bench_sparse_peers", ROOT / "benchmarks" / "bench_sparse_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _selection(t, heads, top_k, coherent, seed=0):
    """A canonical selection of one t-token document: random distinct earlier blocks plus the
    own block; ``coherent``: every token of a 16-token tile draws the same earlier blocks."""
    msa = make_case("one", [[t]], t, "cpu", block_size=BS)["msa"]
    gen = torch.Generator().manual_seed(seed)
    q2k = torch.full((heads, t, top_k), -1, dtype=torch.int32)
    for h in range(heads):
        for p in range(t):
            own = p // BS
            if coherent and p % BS:
                q2k[h, p] = q2k[h, p - 1]
                continue
            ids = torch.randperm(own, generator=gen)[:top_k - 1]
            ids = torch.cat([ids, torch.tensor([own])]).sort().values
            q2k[h, p, :ids.numel()] = ids.to(torch.int32)
    return q2k, msa


def _msa_mask(q2k, msa, group):
    """bool [Hq, T, T]: MSA's keys per query head (selected blocks, causal, one document)."""
    return (selected_key_mask(msa, q2k) & document_causal_mask(msa)[None]).repeat_interleave(
        group, 0)


@pytest.mark.parametrize("coherent", [False, True], ids=["random", "coherent"])
def test_fa4_lists_and_mask_mod_give_msa_mask(coherent):
    """The tile lists with the mask_mod's arithmetic attend exactly MSA's keys (a partial last
    block, 38 blocks: two bitmask words, bit 31 set); the backward lists are the forward's
    transposed; full blocks exist in the coherent case and are wholly visible."""
    t, heads, group, top_k = 600, 2, 2, 4
    q2k, msa = _selection(t, heads, top_k, coherent)
    lists = sf.tile_block_lists(q2k, msa, BS)
    tensors = sf.fa4_block_sparse(lists, group)
    bits = sf.membership_bits(q2k, msa)
    assert bits.shape == (heads, t, 2) and bool((bits < 0).any())  # bit 31 of a word in use

    def mask_mod(h, q, kv):
        return sf.mask_mod_reference(bits, group, BS, h, q, kv)

    got = sf.fa4_dense_mask(tensors["fwd"], t, BS, BS, mask_mod)
    assert torch.equal(got, _msa_mask(q2k, msa, group))
    assert sf.transposed_pairs(tensors["bwd"]) == sf.list_pairs(tensors["fwd"])
    assert tensors["fwd"][0].shape == (1, heads * group, -(-t // BS))
    full = int(lists["full"].sum())
    assert (full > 100) if coherent else (full < int(lists["mask"].sum()))
    # Query heads of one KV head share its lists.
    assert torch.equal(tensors["fwd"][1][0, 0], tensors["fwd"][1][0, 1])


def test_union_bound_lists_and_pair_counts():
    """The union bound attends every key of the tile's union blocks, causally: a superset of
    MSA's mask; union_pairs counts its pairs and the rectangles a union-blocks kernel
    multiplies."""
    t, heads, group, top_k = 600, 2, 2, 4
    q2k, msa = _selection(t, heads, top_k, False, seed=1)
    lists = sf.tile_block_lists(q2k, msa, BS)
    bound = sf.union_bound_lists(lists, BS, BS)
    tensors = sf.fa4_block_sparse(bound, group)
    got = sf.fa4_dense_mask(tensors["fwd"], t, BS, BS, lambda h, q, kv: kv <= q)
    msa_mask = _msa_mask(q2k, msa, group)
    assert bool((got | ~msa_mask).all()) and got.sum() > msa_mask.sum()
    pairs = sf.union_pairs(lists, t, BS, BS)
    assert pairs["causal"] == got.sum().item() / (heads * group)
    rectangles = sf.fa4_dense_mask(tensors["fwd"], t, BS, BS,
                                   lambda h, q, kv: torch.ones_like(q >= kv))
    assert pairs["computed"] == rectangles.sum().item() / (heads * group)


def test_membership_bits_layout():
    """Bit b % 32 of word b // 32 per selected block, stored as int32 (bit 31 negative)."""
    t = 40 * BS
    msa = make_case("one", [[t]], t, "cpu", block_size=BS)["msa"]
    q2k = torch.full((1, t, 3), -1, dtype=torch.int32)
    q2k[0, -1] = torch.tensor([0, 31, 39], dtype=torch.int32)
    q2k[0, 5] = torch.tensor([0, 7, 0], dtype=torch.int32)  # a duplicate and an id past its block
    bits = sf.membership_bits(q2k, msa)
    assert bits[0, -1].tolist() == [1 - 2**31, 1 << 7]
    assert bits[0, 5].tolist() == [1, 0]


def test_interval_mask_gives_msa_mask_and_is_valid():
    """One interval per selected block, clipped causally, empty padding: MSA's mask under the
    documented ``[0, F0) U [F1, F2) ...`` semantics, valid under the plan kernels' rule; a
    decreasing endpoint is refused naming where."""
    t, heads, group, top_k = 600, 2, 2, 4
    q2k, msa = _selection(t, heads, top_k, False, seed=2)
    q2k[:, 300, -1] = -1  # an unused slot
    func = sf.interval_mask(q2k, msa)
    assert func.shape == (heads, 2 * top_k + 1, t)
    sf.check_intervals(func, t)
    got = sf.interval_dense_mask(func, t).repeat_interleave(group, 0)
    assert torch.equal(got, _msa_mask(q2k, msa, group))
    bad = func.clone()
    bad[1, 3, 200] = bad[1, 2, 200] - 1
    with pytest.raises(ValueError, match="head 1, query 200, interval 2"):
        sf.check_intervals(bad, t)


def _masked_side(name, mask, parts, exact, info=None):
    """A stand-in peer: float32 attention of its parts under ``mask`` [Hq, T, T]."""
    def call(part, q, k, v):
        hq = parts[part][0]
        qf = q[0].float().transpose(0, 1)
        grp = q.shape[2] // k.shape[2]
        kf, vf = (x[0].float().transpose(0, 1).repeat_interleave(grp, 0) for x in (k, v))
        scores = (qf @ kf.transpose(1, 2)) / math.sqrt(q.shape[-1])
        probs = scores.masked_fill(~mask[hq], -math.inf).softmax(-1).nan_to_num(0.0)
        return (probs @ vf).transpose(0, 1)[None].to(q.dtype)

    return sp.Side(name, call, parts, batched=True, exact=exact, info=dict(info or {}))


def _standins(args):
    """Stand-ins of the peers from this module's formats: fa4 (tile lists + mask_mod), cudnn_flex
    (interval masks, per KV head), fa4_union (the union bound) and a wrong one claiming to be
    exact (the union bound again)."""
    def fa4(x, q2k, msa, scale, bound=False):
        t, group = msa.num_tokens, args.heads // args.kv_heads
        lists = sf.tile_block_lists(q2k, msa, args.block)
        if bound:
            lists = sf.union_bound_lists(lists, args.block, args.block)
        bits = sf.membership_bits(q2k, msa)
        mask = sf.fa4_dense_mask(
            sf.fa4_block_sparse(lists, group)["fwd"], t, args.block, args.block,
            (lambda h, q, kv: kv <= q) if bound
            else (lambda h, q, kv: sf.mask_mod_reference(bits, group, args.block, h, q, kv)))
        pairs = sf.union_pairs(lists, t, args.block, args.block)
        info = {"computed_pairs": pairs["computed"]}
        if bound:
            info["bound_pairs"] = pairs["causal"]
        return _masked_side("fa4_union" if bound else "fa4", mask, sp.WHOLE, not bound, info)

    def cudnn(x, q2k, msa, scale):
        func = sf.interval_mask(q2k, msa)
        mask = sf.interval_dense_mask(func, msa.num_tokens)
        mask = mask.repeat_interleave(args.heads // args.kv_heads, 0)
        return _masked_side("cudnn_flex", mask, sp.per_kv_head(args.heads, args.kv_heads), True)

    def wrong(x, q2k, msa, scale):
        side = fa4(x, q2k, msa, scale, bound=True)
        side.name, side.exact = "wrong", True
        return side

    return {"fa4": fa4, "fa4_union": lambda *a: fa4(*a, bound=True), "cudnn_flex": cudnn,
            "wrong": wrong}


def test_cases_with_standin_peers(tmp_path):
    """The benchmark's cases on the CPU (reference backend, small heads; fresh, and trained,
    whose calibrated selection goes through the coherent regime's hook): stand-ins built from
    the conversions match ours within tolerance and are timed with their pair rates; the union
    bound is not checked and rates with its own pairs; a wrong exact peer fails its check and is
    not timed; the JSON and the table carry it all."""
    cli = _cli()
    args = cli.parse(["--tokens", "96", "--regimes", "fresh,trained", "--device", "cpu",
                      "--backend", "reference", "--heads", "4", "--kv-heads", "2",
                      "--head-dim", "16", "--index-heads", "2", "--block", str(BS),
                      "--top-k", "3", "--warmup", "1", "--steps", "1", "--subset", "8",
                      "--json", str(tmp_path / "peers.json")])
    args.peers = ["fa4", "fa4_union", "cudnn_flex", "wrong"]
    payload = cli.run(args, _standins(args), [])
    assert [r["case"] for r in payload["results"]] == ["fresh96", "trained96"]
    for r in payload["results"]:
        assert set(r["errors"]) == {"wrong_check"}, r["errors"]
        assert r["ours_out_err_f64"] < 1e-2 and r["ours_dq_err_f64"] < 1e-2
        for name in ("fa4", "cudnn_flex"):
            assert r[f"{name}_check_ok"] and r[f"{name}_dk_err"] < 1e-2
            assert r[f"{name}_pair_rate_fwdbwd"] > 0
        assert not r["wrong_check_ok"] and "wrong_fwd_ms" not in r
        assert "fa4_union_out_err" not in r and r["fa4_union_fwdbwd_ms"] > 0
        assert r["fa4_union_bound_pairs"] > r["pairs_msa"]
        assert r["fa4_computed_over_useful"] > 1 and r["cudnn_dense_fwdbwd_ms"] > 0
    trained = payload["results"][1]
    assert trained["trained_union_target"] > 0 and trained["noise"] > 0
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert len(saved["results"]) == 2
    table = cli.fmt_table(payload["results"], payload["notes"], ["ours", *args.peers])
    assert "| trained96 fa4 | 96 |" in table and "wrong_check: differs from ours" in table


def test_peer_import_error_names_the_module():
    """A peer that does not import is recorded with the missing module; the others go on."""
    found = sp.import_peers(["fa4"], ["/nonexistent"])
    if not isinstance(found["fa4"], Exception):
        pytest.skip("flash-attn-4 imports here")
    assert "missing module" in str(found["fa4"]) and found["fa4"].missing


def _peer_site() -> str | None:
    site = os.environ.get("SPARSE_PEERS_SITE")
    return site if site and Path(site).is_dir() else None


@pytest.mark.skipif(_peer_site() is None,
                    reason="set SPARSE_PEERS_SITE to a pip --target directory holding "
                    "flash-attn-4 4.0.0b40 and nvidia-cutlass-dsl 4.8.1 (peer_wheels.sh)")
def test_fa4_kernels_compile_for_sm90_on_the_cpu():
    """FA4's block-sparse forward and backward, called as ``fa4_side`` calls them
    (``flash_attn_func`` with ``fa4_kwargs``, then its autograd function's backward), with the
    mask_mod and causal without it (the union bound), compile for sm_90a under torch's fake
    tensors (FA4's cross-compilation path: FLASH_ATTENTION_ARCH, CUTE_DSL_ARCH,
    FLASH_ATTENTION_NUM_SMS), at the M3 head shape; in a subprocess, so the arch settings are
    read before anything caches them."""
    script = f"""
import sys
sys.path[:0] = [{str(ROOT / 'benchmarks')!r}, {str(ROOT)!r}]
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from msa_bench import sparse_peers as sp
fa4 = sp.import_peers(["fa4"], [{_peer_site()!r}])["fa4"]
T, HQ, HKV, D, M = 1024, 64, 4, 128, 8
with FakeTensorMode():
    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="cuda")
    lists = tuple(empty(1, HQ, M, dtype=torch.int32) if i % 2 == 0
                  else empty(1, HQ, M, 4, dtype=torch.int32) for i in range(4))
    tensors = {{"fwd": lists, "bwd": lists}}
    for bits in (empty(HKV, T, 1, dtype=torch.int32), None):
        # flash_attn_func as fa4_side calls it, forward and backward.
        kwargs = sp.fa4_kwargs(fa4, tensors, bits, HQ // HKV, 128, D ** -0.5)
        q = empty(1, T, HQ, D).requires_grad_()
        k, v = (empty(1, T, HKV, D).requires_grad_() for _ in "kv")
        out = fa4.flash_attn_func(q, k, v, **kwargs)[0]
        # The function's own backward, called directly: the autograd engine needs a CUDA
        # device for CUDA tensors, fake ones included.
        dq, dk, *_ = out.grad_fn.apply(torch.empty_like(out), None)
        print("bound" if bits is None else "mask_mod", "compiled", tuple(out.shape),
              tuple(dq.shape), tuple(dk.shape))
"""
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90a", CUTE_DSL_ARCH="sm_90a",
               FLASH_ATTENTION_NUM_SMS="132", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mask_mod compiled (1, 1024, 64, 128) (1, 1024, 64, 128) (1, 1024, 4, 128)" in \
        done.stdout
    assert "bound compiled (1, 1024, 64, 128)" in done.stdout


@pytest.mark.gpu
def test_peers_match_our_op_on_the_gpu():
    """On a GPU with the peers installed (SPARSE_PEERS_SITE): FA4 with the mask_mod and cuDNN-FE
    flex attention give our op's out, dq, dk, dv (M3 heads, 2048 tokens, coherent selection)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the peers' kernels)")
    if _peer_site() is None:
        pytest.skip("set SPARSE_PEERS_SITE to the peers' pip --target directory")
    cli = _cli()
    args = cli.parse(["--tokens", "2048", "--regimes", "coherent", "--warmup", "1",
                      "--steps", "1", "--no-dense"])
    mods = sp.import_peers(args.peers, [_peer_site()])
    for name, mod in mods.items():
        if isinstance(mod, Exception):
            pytest.skip(f"{name}: {mod}")
    payload = cli.run(args, mods, [_peer_site()])
    r = payload["results"][0]
    for name in ("fa4", "cudnn_flex"):
        assert r.get(f"{name}_check_ok"), (name, {k: v for k, v in r.items() if "err" in k})
