"""benchmarks/bench_flash_msa_peer.py and benchmarks/msa_bench/flash_msa_peer.py:
the layout and top-k
conversions to poolside's flash-msa, the float64 reference of its token-level KL gradient, the
clear exit where it cannot be imported, the table/JSON writer; on a GPU with flash-msa, one small
run of the peer beside ours."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from msa_bench import flash_msa_peer as peer
from msa_bench.cases import make_case

from nemo_msa.testing.oracle import rel_err, select_rows_f64

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)


def _cli():
    spec = importlib.util.spec_from_file_location(
        "bench_flash_msa_peer", ROOT / "benchmarks" / "bench_flash_msa_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _markers(t, h, d):
    """x[t, h, d] = 10000 t + 100 h + d: every element names its place."""
    return (torch.arange(t)[:, None, None] * 10000 + torch.arange(h)[None, :, None] * 100
            + torch.arange(d)[None, None, :]).double()


def test_layout_round_trip_places_rows_and_heads():
    b, s, h, d = 3, 256, 5, 4
    x = _markers(b * s, h, d)
    y = peer.to_bhsd(x, b)
    assert y.shape == (b, h, s, d) and y.is_contiguous()
    for bi, hi, si in ((0, 0, 0), (1, 3, 17), (2, 4, 255)):
        assert torch.equal(y[bi, hi, si], x[bi * s + si, hi])
    assert torch.equal(peer.from_bhsd(y), x)
    one = peer.to_bhsd(x[:, 2], b)  # a [T, D] single head (the shared index key)
    assert one.shape == (b, 1, s, d) and torch.equal(one[1, 0, 7], x[s + 7, 2])
    with pytest.raises(ValueError, match="tokens=768 is not a multiple of batch=5"):
        peer.to_bhsd(x, 5)


def test_peer_output_layout_back_to_compact():
    b, s, h, d = 2, 128, 3, 4
    x = _markers(b * s, h, d)
    # flash-msa builds its output as o_main (B, H, S, D).transpose(1, 2).reshape(B, S, -1)
    out = peer.to_bhsd(x, b).transpose(1, 2).reshape(b, s, -1)
    assert torch.equal(peer.peer_out_to_thd(out, h), x)
    with pytest.raises(ValueError, match="not a multiple of heads=5"):
        peer.peer_out_to_thd(out, 5)


def test_proxy_tensors_pad_narrow_index_heads_without_changing_scores():
    gen = torch.Generator().manual_seed(0)
    iq, ik = torch.randn(256, 2, 64, generator=gen), torch.randn(256, 64, generator=gen)
    qp, kp = peer.proxy_tensors(iq, ik, 2)
    assert qp.shape == (2, 2, 128, 128) and kp.shape == (2, 1, 128, 128)
    ref = torch.einsum("thd,sd->hts", iq[:128], ik[:128])
    assert torch.allclose(qp[0] @ kp[0].transpose(-1, -2), ref, atol=1e-5)
    full_q, full_k = peer.proxy_tensors(torch.randn(128, 2, 128), torch.randn(128, 128), 1)
    assert full_q.shape == (1, 2, 128, 128) and full_k.shape == (1, 1, 128, 128)
    with pytest.raises(ValueError, match="index head dim 192"):
        peer.proxy_tensors(torch.randn(128, 2, 192), torch.randn(128, 192), 1)


def test_top_k_blocks_to_tokens():
    assert peer.peer_top_k(16, 128) == 2048
    assert peer.peer_top_k(32, 128) == 4096
    with pytest.raises(ValueError, match="block_size=64"):
        peer.peer_top_k(16, 64)
    with pytest.raises(ValueError, match="top_k=33 blocks"):
        peer.peer_top_k(33, 128)


def test_flash_ids_to_canonical_q2k():
    b, hp, s, kb = 2, 2, 384, 2  # 3 blocks; the sentinel is 3
    ids = torch.empty(b, hp, s, kb, dtype=torch.int32)
    ids[:, :, :128] = torch.tensor([0, 3], dtype=torch.int32)  # one candidate, one sentinel
    ids[:, :, 128:256] = torch.tensor([1, 0], dtype=torch.int32)  # score order: own block first
    ids[:, :, 256:] = torch.tensor([2, 1], dtype=torch.int32)
    ids[1, 1, 300] = torch.tensor([2, 0], dtype=torch.int32)  # one row differs
    q2k = peer.flash_ids_to_q2k(ids)
    assert q2k.shape == (hp, b * s, kb) and q2k.dtype == torch.int32
    assert q2k[0, 5].tolist() == [0, -1] and q2k[1, 200].tolist() == [0, 1]
    assert q2k[0, 300].tolist() == [1, 2] and q2k[1, 300].tolist() == [1, 2]
    assert q2k[1, s + 300].tolist() == [0, 2] and q2k[0, s + 300].tolist() == [1, 2]
    agree = peer.row_agreement(q2k, peer.flash_ids_to_q2k(ids[:, [1, 0]]))
    assert agree.sum().item() == hp * b * s - 2  # rows (head 1, s + 300) and (head 0, same)


def test_kl_gradient_reference_matches_the_peers_eager_formula():
    """The row-subset float64 gradient of the peer's token-level KL equals the gradient of its
    eager model's dense formula, and its selection rule equals ours (init 0, local 1)."""
    gen = torch.Generator().manual_seed(1)
    b, s, hq, hkv, hp, d, dp, top = 2, 512, 8, 2, 2, 32, 16, 2
    t = b * s
    iq, ik = torch.randn(t, hp, dp, generator=gen), torch.randn(t, dp, generator=gen)
    q, k = torch.randn(t, hq, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    scale = 1 / math.sqrt(d)
    msa = make_case("peer", [[s]] * b, s, "cpu")["msa"]
    dense, chosen = peer.peer_kl_grad_dense_f64(iq, ik, q, k, b, top, scale)
    q2k = peer.flash_ids_to_q2k(chosen)
    rows = torch.tensor([0, 1, 130, 300, 511, 512, 700, t - 1])
    ours = select_rows_f64(iq, ik, msa, rows, top_k=top, init_blocks=0, local_blocks=1,
                           block_size=128)
    assert torch.equal(q2k[:, rows], ours)
    got = peer.peer_kl_grad_rows_f64(iq, ik, q, k, q2k, msa, rows, scale)
    assert got.shape == (rows.numel(), hp, dp) and dense[rows].norm() > 0
    assert rel_err(got, dense[rows]) < 1e-10
    assert got[0].abs().max() == 0  # the first token sees one key: KL 0, no gradient


def test_semantic_notes_name_the_differences():
    base = peer.semantic_notes(init_blocks=0, local_blocks=1, index_dim=128)
    assert any("token-level" in n for n in base) and any("bf16" in n for n in base)
    assert not any("forced blocks" in n or "zero-padded" in n for n in base)
    more = peer.semantic_notes(init_blocks=1, local_blocks=1, index_dim=64)
    assert any("forced blocks: ours init=1" in n for n in more)
    assert any("index head dim 64 zero-padded" in n for n in more)


def test_missing_flash_msa_exits_2_with_one_line_naming_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "flash_msa", None)  # import flash_msa now fails
    with pytest.raises(SystemExit) as info:
        _cli().main(["--json", str(tmp_path / "peer.json")])
    assert info.value.code == 2
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln]
    assert len(lines) == 1 and "missing module: flash_msa" in lines[0]
    assert not (tmp_path / "peer.json").exists()


def test_missing_dependency_is_named(monkeypatch):
    """flash-msa imports but FlashAttention-4's CuTe interface does not."""
    for name in peer.PEER_MODULES[:4]:
        monkeypatch.setitem(sys.modules, name, type(sys)(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    with pytest.raises(peer.PeerImportError, match="missing module: flash_attn") as info:
        peer.import_peer()
    assert info.value.missing.startswith("flash_attn")


def test_site_dirs_process_pth_files(monkeypatch, tmp_path):
    """A pip --target directory's .pth files run (cutlass is importable only through one)."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "peer_pth_probe.py").write_text("VALUE = 7\n")
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "probe.pth").write_text(str(extra) + "\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(peer, "PEER_MODULES", ("peer_pth_probe",))
    monkeypatch.delitem(sys.modules, "peer_pth_probe", raising=False)
    assert peer.import_peer([str(site_dir), str(tmp_path / "absent")]).VALUE == 7


def test_extension_build_finds_a_toolkit_with_headers(monkeypatch, tmp_path):
    """torch's CUDA_HOME guess without headers is replaced by a toolkit that has them; a toolkit
    without cusparse.h gets the pip CUDA wheels' include dirs after any earlier ones."""
    import torch.utils.cpp_extension as cpp_ext

    nvidia = pytest.importorskip("nvidia", reason="torch's pip CUDA wheels are not installed")
    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "bin").mkdir()
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    (toolkit / "bin" / "nvcc").write_text("")
    for name in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", "/earlier")
    monkeypatch.setattr(cpp_ext, "CUDA_HOME", str(tmp_path / "no-headers-here"))
    done = peer.prepare_extension_build(candidates=(str(toolkit),))
    assert done["cuda_home"] == str(toolkit) == cpp_ext.CUDA_HOME == os.environ["CUDA_HOME"]
    wheels = [str(p) for b in nvidia.__path__ for p in Path(b).glob("*/include")
              if (p / "cusparse.h").is_file()]
    if wheels:
        parts = os.environ["CPLUS_INCLUDE_PATH"].split(os.pathsep)
        assert parts[0] == "/earlier" and set(wheels) <= set(parts[1:])
    (toolkit / "include" / "cusparse.h").write_text("")
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", "/earlier")
    assert peer.prepare_extension_build(candidates=(str(toolkit),)) == {}
    assert os.environ["CPLUS_INCLUDE_PATH"] == "/earlier"


def test_table_and_json_keep_failures_visible(tmp_path):
    ok = {"case": "doc32768x1-coherent", "tokens": 32768, "sel_agree": 0.9876,
          "flash_fwd_ms": 10.0, "ours_fwd_ms": 5.0, "dense_fwd_ms": 29.3,
          "flash_fwdbwd_ms": 40.0, "ours_fwdbwd_ms": 20.0, "dense_fwdbwd_ms": 113.0,
          "flash_over_ours_fwdbwd": 2.0, "flash_first_fwdbwd_ms": [9000.0, 4000.5],
          "flash_out_err": 3e-3, "ours_out_err": 2e-3, "flash_dq_err": 4e-3,
          "flash_diq_err": 1e-2, "flash_vs_ours_out": 5e-3, "errors": {}}
    bad = {"case": "doc131072x1-coherent", "tokens": 131072, "ours_fwd_ms": 50.0,
           "flash_out_err": float("nan"), "errors": {"flash_fwdbwd": "RuntimeError: boom"}}
    text = peer.fmt_table([ok, bad], ["a note"])
    lines = text.splitlines()
    assert lines[0] == peer.HEAD and lines[1].count("---") == peer.HEAD.count("|") - 1
    assert "| doc32768x1-coherent | 32768 | 0.988 | 10.0 | 5.0 | 29.3 | 40.0 | 20.0 | 113.0 " \
           "| 2.00x | 9000.0/4000.5 | 3.0e-03 |" in lines[2]
    assert lines[2].endswith("| - |")
    assert "| n/a |" in lines[3] and "| nan |" in lines[3] and lines[3].endswith(
        "| flash_fwdbwd |")
    assert "- a note" in text
    assert "- error doc131072x1-coherent / flash_fwdbwd: RuntimeError: boom" in text
    path = tmp_path / "peer.json"
    peer.write_json(path, {"results": [ok, bad], "wall_s": float("inf")})

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    loaded = json.loads(path.read_text(), parse_constant=refuse)
    assert loaded["results"][1]["flash_out_err"] == "nan" and loaded["wall_s"] == "inf"
    assert loaded["results"][0]["flash_first_fwdbwd_ms"] == [9000.0, 4000.5]


def _eager_peer():
    """flash-msa's semantics as its eager model (tests/testing_model.py) states them, in float32
    torch: the stand-in that lets the benchmark's case logic run on the CPU."""

    def select(qp, kp, *, scale, num_blocks, top_k_blocks):
        b, hp, s, _ = qp.shape
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        ps = (qp.float() @ kp.float().transpose(-1, -2)) * scale
        blocks = ps.masked_fill(causal, -math.inf).view(b, hp, s, num_blocks, 128).amax(-1)
        own = (torch.arange(s) // 128).view(1, 1, s, 1).expand(b, hp, s, 1)
        ids = blocks.scatter(3, own, math.inf).topk(top_k_blocks, dim=-1).indices
        return torch.where(ids > own, num_blocks, ids).to(torch.int32)

    def func(qp, kp, q, k, v, top_k, scale):
        b, hp, s, _ = qp.shape
        hq, hkv, nb = q.shape[1], k.shape[1], s // 128
        ids = select(qp.detach(), kp.detach(), scale=scale, num_blocks=nb,
                     top_k_blocks=top_k // 128).long()
        bmask = torch.zeros(b, hp, s, nb + 1, dtype=torch.bool).scatter_(3, ids, True)[..., :nb]
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        tmask = bmask[..., None].expand(b, hp, s, nb, 128).reshape(b, hp, s, s) & ~causal
        kf, vf = (x.float().repeat_interleave(hq // hkv, 1) for x in (k, v))
        main = (q.float() @ kf.transpose(-1, -2)) * scale
        probs = torch.softmax(main.masked_fill(~tmask.repeat_interleave(hq // hp, 1),
                                               -math.inf), -1)
        out = (probs @ vf).to(q.dtype).transpose(1, 2).reshape(b, s, -1)
        teacher = probs.detach().view(b, hp, hq // hp, s, s).mean(2)
        log_q = torch.log_softmax(((qp.float() @ kp.float().transpose(-1, -2)) * scale)
                                  .masked_fill(~tmask, -math.inf), -1)
        terms = torch.where(tmask & (teacher > 0),
                            teacher * (torch.log(teacher.clamp_min(1e-30)) - log_q), 0.0)
        return out, terms.sum(-1).mean()

    return SimpleNamespace(flash_msa_func=func,
                           msa_select_cutedsl=SimpleNamespace(select_blocks=select))


def test_case_logic_runs_on_the_cpu_with_an_eager_peer(monkeypatch, call_once_timing):
    """One case of the benchmark end to end on the CPU (reference backend, flash-msa replaced by
    its eager model, calls instead of CUDA timing, top-2 of 4 blocks): no step fails, and the
    checks find both sides near float64 and near each other."""
    cli = _cli()
    monkeypatch.setattr(cli, "TOPK", 2)
    calls = call_once_timing(cli)
    args = cli.build_parser().parse_args(
        ["--device", "cpu", "--backend", "reference", "--sets", "1", "--subset", "8",
         "--no-dense", "--batch", "2"])
    row = cli.run_case(512, "coherent", args, torch.Generator().manual_seed(0), _eager_peer(),
                       time.monotonic() + 600, {})
    assert row["errors"] == {}, row["errors"]
    assert row["case"] == "doc512x2-coherent" and row["tokens"] == 1024 and len(calls) == 6
    assert row["flash_fwdbwd_ms"] == row["ours_fwdbwd_ms"] == 1.0
    assert row["flash_over_ours_fwdbwd"] == 1.0 and len(row["flash_first_fwdbwd_ms"]) == 1
    assert row["ours_sel_f64_agree"] == row["flash_sel_f64_agree"] == 1.0
    assert row["sel_agree"] > 0.99
    for key in ("ours_out_err", "flash_out_err", "ours_dq_err", "flash_dq_err",
                "flash_diq_err", "flash_vs_ours_out"):
        assert 0 <= row[key] < 2e-2, (key, row[key])
    skipped = cli.run_case(512, "random", args, torch.Generator(), _eager_peer(), 0.0, {})
    assert skipped["errors"]["inputs"].startswith("skipped: the --budget-s")

    def boom(*_args):
        raise RuntimeError("peer kernel failed")

    broken = _eager_peer()
    broken.flash_msa_func = boom
    row = cli.run_case(512, "random", args, torch.Generator().manual_seed(1), broken,
                       time.monotonic() + 600, {})
    flash_steps = {"flash_first_calls", "flash_fwd", "flash_fwdbwd", "flash_outputs"}
    assert set(row["errors"]) == flash_steps
    assert all(row["errors"][k] == "RuntimeError: peer kernel failed" for k in flash_steps)
    assert row["ours_fwdbwd_ms"] == 1.0 and row["ours_out_err"] < 2e-2
    assert row["sel_agree"] > 0.99 and row["flash_sel_ms"] == 1.0  # its selection still ran
    assert "flash_out_err" not in row and "flash_over_ours_fwdbwd" not in row


@pytest.mark.gpu
def test_peer_runs_beside_ours_on_a_small_case(tmp_path):
    """On a GPU with flash-msa (its --target directory in $FLASH_MSA_SITE): one 4096-token case,
    every step without error, finite times, both sides near float64."""
    sites = [d for d in os.environ.get("FLASH_MSA_SITE", "").split(":") if d]
    try:
        peer.import_peer(sites)
    except peer.PeerImportError as exc:
        pytest.skip(f"flash-msa is not importable here: {exc}")
    path = tmp_path / "peer.json"
    _cli().main(["--sizes", "4096", "--inputs", "random", "--sets", "1", "--subset", "16",
                 "--json", str(path)])
    payload = json.loads(path.read_text())
    assert payload["setup"]["errors"] == {}
    (row,) = payload["results"]
    assert row["errors"] == {}, row["errors"]
    for key in ("flash_fwd_ms", "flash_fwdbwd_ms", "ours_fwd_ms", "ours_fwdbwd_ms",
                "dense_fwd_ms", "flash_sel_ms"):
        assert isinstance(row[key], float) and 0 < row[key] < 1e5, (key, row[key])
    assert row["ours_out_err"] < 2e-2 and row["flash_out_err"] < 2e-2
    assert row["ours_dq_err"] < 5e-2 and row["flash_dq_err"] < 5e-2
    assert row["flash_diq_err"] < 1e-1
    assert 0.5 < row["sel_agree"] <= 1.0
