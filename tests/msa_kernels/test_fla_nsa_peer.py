"""benchmarks/bench_fla_nsa_peer.py and benchmarks/msa_bench/fla_nsa_peer.py:
our q2k and documents as
fla-core's NSA block_indices and cu_seqlens, the float64 oracle of fla's rules, the checks of the
peer's call, the table; fla-core's kernels themselves (the Triton interpreter on the CPU, compiled
on a GPU) against our reference on packed documents; the benchmark's case logic with a stand-in
of the peer; on a GPU, one small run of the benchmark."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from msa_bench import fla_nsa_peer as peer
from msa_bench.cases import make_case

from nemo_msa.attention.naive import (
    sparse_attention_backward_reference,
    sparse_attention_forward_reference,
)
from nemo_msa.testing.oracle import attention_f64, attention_grads_f64, rel_err

ROOT = Path(__file__).resolve().parents[2]

BS = 16
# fla-core says so once when its kernels are first used on CPU tensors (the interpreter runs them).
pytestmark = [pytest.mark.bench, pytest.mark.filterwarnings(
    "ignore:Triton is not supported on current platform:UserWarning")]


def _cli():
    spec = importlib.util.spec_from_file_location(
        "bench_fla_nsa_peer", ROOT / "benchmarks" / "bench_fla_nsa_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _packed(device="cpu"):
    """Two rows: documents of 40, 70 and 9 tokens (partial blocks, padding), and one of 100."""
    return make_case("packed", [[40, 70, 9], [100]], 128, device, block_size=BS)["msa"]


def _random_q2k(msa, heads, top_k, gen):
    """Canonical random selections: ascending distinct ids in [0, own block], -1 at the tail
    (fewer candidates than slots early in a document)."""
    pos = msa.document_positions.long().cpu()
    q2k = torch.full((heads, msa.num_tokens, top_k), -1, dtype=torch.int32)
    for h in range(heads):
        for t in range(msa.num_tokens):
            own = int(pos[t]) // BS
            ids = torch.randperm(own + 1, generator=gen)[:top_k].sort().values
            q2k[h, t, :ids.numel()] = ids.to(torch.int32)
    return q2k.to(msa.cu_seqlens.device)


def test_block_indices_transpose_and_pad_to_a_power_of_two():
    gen = torch.Generator().manual_seed(0)
    msa = _packed()
    q2k = _random_q2k(msa, 2, 3, gen)
    assert (q2k == -1).any() and (q2k >= 0).any()
    bi = peer.q2k_to_block_indices(q2k)
    assert bi.shape == (1, msa.num_tokens, 2, 4) and bi.dtype == torch.int32 and bi.is_contiguous()
    for h, t in ((0, 0), (1, 5), (0, 150), (1, msa.num_tokens - 1)):
        assert bi[0, t, h, :3].tolist() == q2k[h, t].tolist()
        assert bi[0, t, h, 3] == -1
    assert peer.q2k_to_block_indices(q2k, slots=8).shape[-1] == 8
    assert [peer.slots_for(k) for k in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]
    with pytest.raises(ValueError, match="slots=2: expected a power of two >= top_k=3"):
        peer.q2k_to_block_indices(q2k, slots=2)
    with pytest.raises(ValueError, match="slots=6"):
        peer.q2k_to_block_indices(q2k, slots=6)
    with pytest.raises(ValueError, match="q2k: expected an integer"):
        peer.q2k_to_block_indices(q2k.float())


def test_documents_become_cu_seqlens_and_one_document_the_dense_path():
    msa = _packed()
    cu = peer.fla_cu_seqlens(msa)
    assert cu.dtype == torch.int64 and cu.tolist() == [0, 40, 110, 119, 219]
    one = make_case("one", [[96]], 96, "cpu", block_size=BS)["msa"]
    assert peer.fla_cu_seqlens(one) is None
    conv = peer.fla_inputs(_random_q2k(one, 1, 2, torch.Generator()), one, BS)
    assert conv["block_counts"] == conv["block_indices"].shape[-1] == 2
    assert conv["cu_seqlens"] is None and conv["block_size"] == BS


def test_check_q2k_refuses_what_the_sides_would_read_differently():
    msa = _packed()
    q2k = _random_q2k(msa, 2, 3, torch.Generator().manual_seed(1))
    peer.check_q2k(q2k, msa, BS)  # canonical: accepted
    t = 60  # document 2, position 20: own block 1
    cases = {"duplicate": [1, 1, -1], "past own block": [0, 2, -1], "gap": [0, -1, 1],
             "descending": [1, 0, -1], "below -1": [-2, -1, -1]}
    for ids in cases.values():
        bad = q2k.clone()
        bad[1, t] = torch.tensor(ids, dtype=torch.int32)
        with pytest.raises(ValueError, match=r"q2k\[1, 60\] = \[.*own block 1"):
            peer.check_q2k(bad, msa, BS)
        bad[1, t] = q2k[1, t]
        peer.check_q2k(bad, msa, BS)  # restored: accepted again


def _inputs(t, hq, h, d, gen, dtype=torch.float32, device="cpu"):
    return [torch.randn(t, n, d, generator=gen).to(device, dtype) for n in (hq, h, h, hq)]


def test_fla_rules_on_the_converted_selection_are_our_function():
    """The float64 oracle of fla's rules on the converted q2k equals our float64 attention on
    the q2k (packed documents, -1 padding, partial blocks), and our reference kernel; the
    oracle is sensitive: global block ids or a duplicated slot change the result."""
    gen = torch.Generator().manual_seed(2)
    msa = _packed()
    q, k, v, _ = _inputs(msa.num_tokens, 32, 2, 8, gen)
    q2k = _random_q2k(msa, 2, 3, gen)
    conv = peer.fla_inputs(q2k, msa, BS)
    scale = 8 ** -0.5
    got = peer.fla_semantics_f64(q[None], k[None], v[None], conv["block_indices"],
                                 conv["cu_seqlens"], BS, scale)[0]
    ref, _ = attention_f64(q, k, v, q2k, msa, scale, BS)
    assert rel_err(got, ref) < 1e-12
    ours, _ = sparse_attention_forward_reference(q, k, v, q2k, msa, scale)
    assert rel_err(ours, ref) < 1e-5
    wrong = peer.fla_semantics_f64(q[None], k[None], v[None], conv["block_indices"], None, BS,
                                   scale)[0]  # every id read from the start of the pack
    assert rel_err(wrong, ref) > 1e-2
    dup = conv["block_indices"].clone()
    rows = q2k[0, :, 1] >= 0  # two blocks or more: a doubled one shifts the softmax
    assert rows.sum() > 20 and (dup[0, :, 0, 3] == -1).all()
    dup[0, rows, 0, 3] = dup[0, rows, 0, 0]  # the same set, one block listed twice
    twice = peer.fla_semantics_f64(q[None], k[None], v[None], dup, conv["cu_seqlens"], BS,
                                   scale)[0]
    assert rel_err(twice[rows, :16], ref[rows, :16]) > 1e-2  # KV head 0's query heads
    assert rel_err(twice[:, 16:], ref[:, 16:]) < 1e-12


def test_fla_attention_checks_what_the_peer_cannot_take():
    msa = _packed()
    gen = torch.Generator().manual_seed(3)
    conv = peer.fla_inputs(_random_q2k(msa, 2, 2, gen), msa, BS)

    def never(*_a):
        raise AssertionError("the peer must not be called")

    fn = SimpleNamespace(apply=never)
    q, k, v, _ = _inputs(msa.num_tokens, 16, 2, 8, gen)
    with pytest.raises(ValueError, match="HQ=16, H=2: fla's NSA needs HQ / H a power of two"):
        peer.fla_attention(fn, q, k, v, conv, 1.0)
    q, k, v, _ = _inputs(msa.num_tokens, 32, 2, 8, gen)
    with pytest.raises(ValueError, match="expected .* torch.float32"):
        peer.fla_attention(fn, q, k.half(), v, conv, 1.0)
    with pytest.raises(ValueError, match=r"block_indices \(1, 219, 2, 2\): expected \[1, 100"):
        peer.fla_attention(fn, q[:100], k[:100], v[:100], conv, 1.0)
    with pytest.raises(ValueError, match="block_size=24"):
        peer.fla_attention(fn, q, k, v, {**conv, "block_size": 24}, 1.0)
    seen = {}

    def record(*args):
        seen["args"] = args
        return torch.zeros(1, *q.shape)

    out = peer.fla_attention(SimpleNamespace(apply=record), q, k, v, conv, 0.5)
    assert out.shape == q.shape
    aq, ak, av, bi, counts, bs, scale, cu = seen["args"]
    assert aq.shape == (1, *q.shape) and ak.shape == (1, *k.shape) and av.shape == (1, *v.shape)
    assert bi is conv["block_indices"] and counts == 2 and bs == BS and scale == 0.5
    assert cu.tolist() == msa.cu_seqlens.tolist()


def test_import_failure_names_the_module(tmp_path, monkeypatch):
    monkeypatch.setattr(peer, "PEER_MODULES", ("fla_absent_module",))
    with pytest.raises(peer.PeerImportError, match="missing module: fla_absent_module"):
        peer.import_peer([str(tmp_path)])


def _fla_or_skip():
    try:
        return peer.import_peer([d for d in os.environ.get("FLA_SITE", "").split(":") if d])
    except peer.PeerImportError as exc:
        pytest.skip(f"fla-core is not importable here (pip install -e '.[test,bench]' "
                    f"-c constraints.txt installs it): {exc}")


@pytest.mark.parametrize("layout,config", [("packed", 0), ("one", -1)])
def test_fla_kernels_match_our_reference(layout, config):
    """fla-core's ParallelNSAFunction, forward and gradients, on the converted q2k against
    float64 and our reference kernels: packed documents through its varlen path (first launch
    configuration), one document through its dense path (the last one: the dk/dv kernel's
    widest query gather). Float32, since the CPU interpreter cannot run bf16 here; each
    autotuned kernel pinned to one configuration (see single_config_autotune)."""
    fla = _fla_or_skip()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(4)
    def layout_on(device):
        if layout == "packed":
            return _packed(device)
        return make_case("one", [[80]], 80, device, block_size=BS)["msa"]

    msa, msa_cpu = layout_on(dev), layout_on("cpu")
    q, k, v, do = _inputs(msa.num_tokens, 32, 2, 16, gen, device=dev)
    q2k = _random_q2k(msa, 2, 3, gen)
    scale = 16 ** -0.5
    conv = peer.fla_inputs(q2k, msa, BS)
    assert (conv["cu_seqlens"] is None) == (layout == "one")
    x = {n: a.clone().requires_grad_(True) for n, a in (("q", q), ("k", k), ("v", v))}
    with peer.single_config_autotune(config if config >= 0 else 99) as pinned:
        out = peer.fla_attention(fla, x["q"], x["k"], x["v"], conv, scale)
        out.backward(do)
    assert "fla.ops.nsa.parallel.parallel_nsa_bwd_kernel_dkv" in pinned
    o64, _, dq64, dk64, dv64 = attention_grads_f64(q.cpu(), k.cpu(), v.cpu(), q2k.cpu(),
                                                   msa_cpu, scale, BS, do.cpu())
    tol = 1e-5 if dev == "cpu" else 2e-2  # the GPU's float32 dots may run in tf32
    errs = {n: rel_err(a.cpu(), b) for n, a, b in (
        ("out", out.detach(), o64), ("dq", x["q"].grad, dq64), ("dk", x["k"].grad, dk64),
        ("dv", x["v"].grad, dv64))}
    assert all(e < tol for e in errs.values()), errs
    ours, lse = sparse_attention_forward_reference(q, k, v, q2k, msa, scale)
    dq, dk, dv = sparse_attention_backward_reference(do, q, k, v, ours, lse, q2k, msa, scale)
    for name, a, b in (("out", out.detach(), ours), ("dq", x["q"].grad, dq),
                       ("dk", x["k"].grad, dk), ("dv", x["v"].grad, dv)):
        assert rel_err(a, b) < tol, (name, rel_err(a, b))


def test_table_keeps_failures_visible():
    ok = {"case": "doc8192-coherent", "tokens": 8192, "docs": 1, "fla_fwd_ms": 4.0,
          "ours_fwd_ms": 2.0, "fla_over_ours_fwd": 2.0, "fla_out_err": 3e-3, "errors": {}}
    bad = {"case": "packed8192-random", "tokens": 8190, "fla_out_err": float("nan"),
           "errors": {"fla_fwdbwd": "RuntimeError: boom"}}
    text = peer.fmt_table([ok, bad], ["a note"])
    lines = text.splitlines()
    assert lines[0] == peer.HEAD and lines[1].count("---") == peer.HEAD.count("|") - 1
    assert lines[2].startswith("| doc8192-coherent | 8192 | 1 | 4.0 | 2.0 | n/a |")
    assert "| 2.00x |" in lines[2] and "| 3.0e-03 |" in lines[2] and lines[2].endswith("| - |")
    assert "| nan |" in lines[3] and lines[3].endswith("| fla_fwdbwd |")
    assert "- a note" in text and "- error packed8192-random / fla_fwdbwd: RuntimeError: boom" \
        in text


def _standin():
    """fla's rules as the float64 oracle, behind the Function's ``apply``: lets the benchmark's
    case logic run on the CPU with bf16 inputs (which the interpreter cannot run through fla)."""

    def apply(q, k, v, bi, counts, bs, scale, cu):
        assert counts == bi.shape[-1]
        return peer.fla_semantics_f64(q, k, v, bi, cu, bs, scale).to(q.dtype)

    return SimpleNamespace(apply=apply)


def test_case_logic_runs_on_the_cpu_with_a_standin(monkeypatch, call_once_timing):
    """One document and packed documents end to end on the CPU (reference backend, top-2 of
    the blocks, calls instead of CUDA timing): no step fails, both sides land near float64 and
    near each other; a failing peer is recorded step by step while ours still runs."""
    cli = _cli()
    monkeypatch.setattr(cli, "TOPK", 2)
    monkeypatch.setattr(cli, "PACK_LO", 100)
    monkeypatch.setattr(cli, "PACK_ROW", 384)
    calls = call_once_timing(cli)
    args = cli.build_parser().parse_args(
        ["--device", "cpu", "--backend", "reference", "--sets", "1", "--subset", "8",
         "--no-dense"])
    host = torch.Generator().manual_seed(0)
    for layout in ("one", "packed"):
        calls.clear()
        row = cli.run_case(512, layout, "coherent", args, torch.Generator().manual_seed(0),
                           _standin(), time.monotonic() + 600, {}, host)
        assert row["errors"] == {}, row["errors"]
        assert row["case"] == f"{'doc' if layout == 'one' else 'packed'}512-coherent"
        assert (row["docs"] == 1) == (layout == "one") and len(calls) == 6
        assert row["fla_over_ours_fwdbwd"] == row["fla_over_ours_fwd"] == 1.0
        for key in ("ours_out_err", "fla_out_err", "ours_dq_err", "fla_dq_err",
                    "fla_vs_ours_out", "fla_vs_ours_dq", "fla_vs_ours_dk", "fla_vs_ours_dv"):
            assert 0 <= row[key] < 2e-2, (layout, key, row[key])

    def boom(*_a):
        raise RuntimeError("peer kernel failed")

    row = cli.run_case(512, "packed", "random", args, torch.Generator().manual_seed(1),
                       SimpleNamespace(apply=boom), time.monotonic() + 600, {}, host)
    failed = {"fla_first_calls", "fla_fwd", "fla_fwdbwd", "fla_outputs"}
    assert set(row["errors"]) == failed
    assert all(row["errors"][k] == "RuntimeError: peer kernel failed" for k in failed)
    assert row["ours_fwdbwd_ms"] == 1.0 and row["ours_out_err"] < 2e-2
    assert "fla_out_err" not in row and "fla_over_ours_fwdbwd" not in row
    skipped = cli.run_case(512, "one", "random", args, torch.Generator(), _standin(), 0.0, {},
                           host)
    assert skipped["errors"]["inputs"].startswith("skipped: the --budget-s")
    with pytest.raises(ValueError, match="layout 'ragged'"):
        cli.make_layout(512, "ragged", args, host)


def test_missing_peer_exits_2_naming_the_module(monkeypatch, capsys):
    cli = _cli()

    def missing(_sites):
        raise peer.PeerImportError("einops", "import einops: ModuleNotFoundError")

    monkeypatch.setattr(cli, "import_peer", missing)
    with pytest.raises(SystemExit) as info:
        cli.main(["--sizes", "8192"])
    assert info.value.code == 2
    assert "missing module: einops" in capsys.readouterr().out


@pytest.mark.gpu
def test_peer_runs_beside_ours_on_a_small_case(tmp_path):
    """On a GPU with fla-core: one 4096-token case per layout, every step without error, finite
    times, both sides near float64 and near each other."""
    _fla_or_skip()
    path = tmp_path / "fla.json"
    _cli().main(["--sizes", "4096", "--inputs", "random", "--sets", "1", "--subset", "16",
                 "--json", str(path)])
    payload = json.loads(path.read_text())
    assert payload["setup"]["errors"] == {}
    assert [r["layout"] for r in payload["results"]] == ["one", "packed"]
    for row in payload["results"]:
        assert row["errors"] == {}, row["errors"]
        for key in ("fla_fwd_ms", "fla_fwdbwd_ms", "ours_fwd_ms", "ours_fwdbwd_ms",
                    "dense_fwd_ms", "ours_sel_ms"):
            assert isinstance(row[key], float) and 0 < row[key] < 1e5, (key, row[key])
        assert row["ours_out_err"] < 2e-2 and row["fla_out_err"] < 2e-2
        assert row["ours_dq_err"] < 5e-2 and row["fla_dq_err"] < 5e-2
        assert math.isfinite(row["fla_vs_ours_dk"]) and row["fla_vs_ours_dk"] < 5e-2
        assert row["fla_vs_ours_dv"] < 5e-2
