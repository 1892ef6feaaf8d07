"""benchmarks/bench_layer.py end to end on the CPU (--tiny, gloo, the CPU shim): every case and
attention row is measured and lands in the JSON with positive finite numbers, in a subprocess
(the script owns its process group)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

CASES = ("dense", "msa_loss_off", "msa_sparse_loss", "msa_dense_loss", "msa_warmup")
# The cases whose layers select blocks (msa_warmup attends densely in its warm-up).
SELECTING = ("msa_loss_off", "msa_sparse_loss", "msa_dense_loss")
PAIR_FIELDS = ("pairs_dense", "pairs_msa", "msa_attention_ms", "cudnn_attention_ms",
               "pair_rate_vs_cudnn", "msa_attention_tflops", "cudnn_attention_tflops")


def _assert_pair_rate(row: dict, tokens: int) -> None:
    """An MSA row's pair rate: positive finite fields, consistent with each other."""
    for field in PAIR_FIELDS:
        assert isinstance(row[field], (int, float)) and math.isfinite(row[field]), (field, row)
        assert row[field] > 0, (field, row)
    assert "pair_rate_note" not in row, row
    # Dense within documents attends at most one document's causal pairs; the selection fewer.
    assert row["pairs_msa"] <= row["pairs_dense"] <= tokens * (tokens + 1) // 2, row
    assert math.isclose(row["pair_rate_vs_cudnn"],
                        row["msa_attention_tflops"] / row["cudnn_attention_tflops"]), row


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_layer.py"), "--tiny", "--cpu",
           "--steps", "1", "--warmup", "1", "--json", str(tmp_path / "layer.json"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=tmp_path,
                          env={**os.environ, "NEMO_MSA_COMMIT": "test-commit"})


def test_tiny_run_reports_every_case_and_attention_row(tmp_path):
    proc = _run(tmp_path, "--tokens", "64,128", "--profile", "--profile-top", "3",
                "--packed-docs", "10:40")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "layer.json").read_text())
    assert result["commit"] == "test-commit" and result["gpu"] == "cpu"
    assert result["torch"] and "--tiny" in result["command"]
    rows = {(row["tokens"], row["case"]): row for row in result["rows"]}
    attention = ("dense_attention", "cudnn_attention", "dense_attention_packed",
                 "cudnn_attention_packed", "dense_attention_packed_fresh")
    expected = {(t, c) for t in (64, 128) for c in (*CASES, *attention)}
    assert set(rows) == expected and len(result["rows"]) == len(expected)
    for (tokens, case), row in rows.items():
        assert row["status"] == "ok", row
        key = "step_ms" if case in CASES else "fwdbwd_ms"
        value = row[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, row
        assert row["kernels"] and all(k["ms"] > 0 for k in row["kernels"]), row
        if key == "step_ms":
            assert math.isclose(row["tokens_per_s"], tokens / (value / 1e3)), row
        if case in SELECTING:
            _assert_pair_rate(row, tokens)
            # Against the dense row of its tokens and layers.
            dense = rows[(tokens, "dense")]["step_ms"]
            assert 0 < row["bound_ms"] and math.isclose(row["bound_x_dense"],
                                                        dense / row["bound_ms"]), row
            assert math.isclose(row["fraction_of_bound"], row["bound_ms"] / value), row
        else:
            assert not set(PAIR_FIELDS) & set(row), row
            assert "bound_ms" not in row, row
        if "_packed" in case:  # 2..13 documents of 10..40 tokens per row
            assert tokens / 40 <= row["documents_mean"] <= tokens / 10 + 1, row
            assert 0 < row["causal_pairs_vs_one_document"] < 1, row
    # The printed table ends the output, one line per row.
    table = proc.stdout[proc.stdout.index("|  tokens |"):]
    assert sum(line.startswith("|     ") for line in table.splitlines()) == len(expected)
    assert "| x dense | pair rate |" in table
    for line in table.splitlines()[2:len(expected) + 2]:
        cells = [cell.strip() for cell in line.split("|")]
        # The pair rate column (after x dense) is filled on the selecting MSA rows only.
        assert bool(cells[8]) == (cells[3] in SELECTING), line
        if cells[3] in SELECTING:
            assert math.isfinite(float(cells[8])) and float(cells[8]) > 0, line


def test_bad_arguments_fail_before_anything_is_built(tmp_path):
    proc = _run(tmp_path, "--cases", "dense,sparse")
    assert proc.returncode != 0
    assert "--cases='dense,sparse': unknown ['sparse']" in proc.stderr
    proc = _run(tmp_path, "--packed-docs", "40:10")
    assert proc.returncode != 0 and "expected 1 <= MIN <= MAX" in proc.stderr
    proc = _run(tmp_path, "--tokens", "100")
    assert proc.returncode != 0 and "multiples of the block size 16" in proc.stderr
    proc = _run(tmp_path, "--set", "bwd.dq_union_maxx=40")
    assert proc.returncode != 0 and "unknown launch parameter 'bwd.dq_union_maxx'" in proc.stderr
    proc = _run(tmp_path, "--set", "fwd.union_max=many")
    assert proc.returncode != 0 and "fwd.union_max='many': expected int" in proc.stderr
    assert not (tmp_path / "layer.json").exists()


def test_packed_rows_and_two_layers(tmp_path):
    # One row per N and N:MEAN entry; dense and MSA see the same seeded document maps.
    proc = _run(tmp_path, "--tokens", "128,256:64", "--cases", "dense,msa_sparse_loss",
                "--layers", "2", "--no-attention-rows", "--seed", "3", "--host-profile",
                "--set", "bwd.dq_union_max=40", "--set", "fwd.union_tma=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "layer.json").read_text())
    assert result["layers"] == 2 and "(seed 3)" in result["documents"]
    assert result["launch_settings"] == {"bwd.dq_union_max": 40, "fwd.union_tma": False}
    for row in result["rows"]:  # --host-profile: the issue time and the top host functions
        assert 0 < row["host_issue_ms"] and math.isfinite(row["host_issue_ms"]), row
        functions = row["host_functions"]
        # (A recursive function's total can be below its self time in cProfile's counting.)
        assert functions and all(f["calls"] >= 1 and f["self_ms"] >= 0 and f["total_ms"] >= 0
                                 for f in functions), row
        assert functions[0]["self_ms"] > 0, row
        assert [f["self_ms"] for f in functions] == sorted((f["self_ms"] for f in functions),
                                                           reverse=True)
    assert "issuing the step took" in proc.stdout
    rows = {(r["tokens"], r["doc_mean"], r["case"]): r for r in result["rows"]}
    assert set(rows) == {(t, m, c) for t, m in ((128, 0), (256, 64))
                         for c in ("dense", "msa_sparse_loss")}
    for (tokens, mean, case), row in rows.items():
        assert row["status"] == "ok" and row["layers"] == 2, row
        if case == "msa_sparse_loss":
            _assert_pair_rate(row, tokens)
        assert row["step_ms"] > 0 and math.isfinite(row["step_ms"]), row
        if mean == 0:
            assert row["docs"] == 1, row
        else:  # 256 tokens of documents of at least 16 (the tiny --doc-min)
            assert 1 < row["docs"] <= 256 / 16, row
            # The warm-up covers the 4 document maps before the timed step.
            assert row["doc_maps"] == 4 and len(row["warmup_ms"]) == 4, row
    assert rows[(256, 64, "dense")]["docs"] == rows[(256, 64, "msa_sparse_loss")]["docs"]


def test_packed_lengths_fill_the_row_with_the_stated_distribution():
    import torch
    from layer_bench.steps import packed_lengths

    generator = torch.Generator().manual_seed(0)
    drawn = [packed_lengths(32768, 4096, 256, generator) for _ in range(200)]
    assert all(sum(sizes) == 32768 and min(sizes) >= 256 for sizes in drawn)
    inner = [n for sizes in drawn for n in sizes[:-1]]  # the last one is cut
    assert 3600 < sum(inner) / len(inner) < 4600
    assert packed_lengths(8192, 0, 256, generator) == [8192]
    again = torch.Generator().manual_seed(0)
    assert packed_lengths(32768, 4096, 256, again) == drawn[0]


def test_rows_parse_n_and_n_mean():
    from layer_bench.rows import parse_rows

    assert parse_rows("8192, 131072:16384", [0], "--tokens") == [(8192, 0), (131072, 16384)]
    with pytest.raises(SystemExit, match="'x:1' is not N or N:MEAN"):
        parse_rows("x:1", [0], "--tokens")
    with pytest.raises(SystemExit, match="expected N > 0"):
        parse_rows("0", [0], "--tokens")


def test_longest_row_search_doubles_then_halves_the_gap():
    from layer_bench.rows import next_length

    # A GPU where rows up to 300000 tokens fit, searched from 262144 at 16384-token resolution.
    ok, failed, tried = 262144, None, []
    while (n := next_length(ok, failed, 1048576, 16384)) is not None:
        tried.append(n)
        ok, failed = (n, failed) if n <= 300000 else (ok, n)
    assert tried == [524288, 393216, 327680, 294912, 311296]
    assert (ok, failed) == (294912, 311296)
    assert next_length(786432, None, 1048576, 16384) == 1048576  # the limit itself, then stop
    assert next_length(1048576, None, 1048576, 16384) is None


def test_grow_to_reports_the_longest_row(tmp_path):
    proc = _run(tmp_path, "--tokens", "64", "--grow-to", "256", "--cases", "msa_loss_off",
                "--no-attention-rows", "--no-pair-rate")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "layer.json").read_text())
    assert [(r["tokens"], r["status"], r.get("search")) for r in result["rows"]] == [
        (64, "ok", None), (128, "ok", "grow-to"), (256, "ok", "grow-to")]
    longest = result["longest"]["msa_loss_off"]
    assert longest["tokens"] == 256 and longest["first_failure"] is None
    assert longest["step_ms"] == result["rows"][-1]["step_ms"] > 0
    assert "msa_loss_off: longest row that ran 256 tokens" in proc.stdout
    proc = _run(tmp_path, "--tokens", "64", "--grow-to", "48")
    assert proc.returncode != 0 and "--grow-to=48: expected a multiple" in proc.stderr


def test_bad_row_arguments(tmp_path):
    proc = _run(tmp_path, "--tokens", "128:x")
    assert proc.returncode != 0 and "'128:x' is not N or N:MEAN" in proc.stderr
    proc = _run(tmp_path, "--tokens", "128:8")
    assert proc.returncode != 0 and "expected 0 or a mean >= --doc-min=16" in proc.stderr


def test_selection_split_and_coherent_index(tmp_path):
    # MSA rows say how their selections split between the Triton kernels; dense rows do not.
    # Coherent index queries (shared per block) make tile unions close to the tokens' own blocks;
    # trained ones are calibrated to a trained indexer's unions, between the two.
    inflation, union = {}, {}
    for index in ("fresh", "coherent", "trained"):
        out = tmp_path / index
        out.mkdir()
        proc = _run(out, "--tokens", "256", "--cases", "dense,msa_sparse_loss",
                    "--no-attention-rows", "--index", index)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = json.loads((out / "layer.json").read_text())
        assert result["index"] == index
        rows = {row["case"]: row for row in result["rows"]}
        assert "union_mean" not in rows["dense"]
        msa = rows["msa_sparse_loss"]
        # The tiny model: blocks of 16, top-4, so a union of 8 tokens holds 4..16 blocks.
        assert msa["union_qt"] == 8 and 4 <= msa["union_mean"] <= 16, msa
        assert 0 < msa["union_kernel_share"] <= 1 and msa["union_inflation"] >= 1, msa
        inflation[index], union[index] = msa["union_inflation"], msa["union_mean"]
        if index == "trained":
            # top-4 on a 256-token row: 13.3 / 8 of the top-k, reached by the calibration.
            assert math.isclose(msa["trained_union_target"], 4 * 13.3 / 8), msa
            assert abs(msa["trained_union"] - msa["trained_union_target"]) < 0.5, msa
            assert 0 < msa["trained_noise"] < 1e4 and "8192" in msa["trained_source"], msa
        else:
            assert not any(key.startswith("trained_") for key in msa), msa
    assert inflation["coherent"] < 1.3 < 1.6 < inflation["fresh"], inflation
    assert union["coherent"] < union["trained"] < union["fresh"], union


def test_step_bound_counts_the_dense_step_with_msa_pairs_at_cudnn_rate():
    from layer_bench.bound import step_bound

    # cuDNN: 1000 pairs per query head in 10 ms; the MSA layer attends 100 of them.
    row = {"pairs_msa": 100, "pairs_dense": 1000, "cudnn_attention_ms": 10.0, "step_ms": 8.0}
    heads, head_dim, index_heads, index_dim, hidden, tokens = 4, 8, 2, 8, 16, 50
    rate = 1000 * 14 * heads * head_dim / 10.0  # FLOP per ms
    scoring = 1000 * 2 * index_heads * index_dim / rate
    projection = 2 * 2 * tokens * hidden * (index_heads + 1) * index_dim / rate
    bound = step_bound(row, 20.0, heads, head_dim, index_heads, index_dim, hidden, tokens)
    expected = 20.0 - 10.0 + 1.0 + scoring + projection
    assert math.isclose(bound["bound_ms"], expected)
    assert math.isclose(bound["bound_x_dense"], 20.0 / expected)
    assert math.isclose(bound["fraction_of_bound"], expected / 8.0)
    two = step_bound({**row, "layers": 2}, 40.0, heads, head_dim, index_heads, index_dim,
                     hidden, tokens)
    assert math.isclose(two["bound_ms"], 40.0 - 2 * (10.0 - 1.0 - scoring - projection))
    assert step_bound({**row, "pairs_msa": None}, 20.0, heads, head_dim, index_heads,
                      index_dim, hidden, tokens) == {}
    # The dense step's own attention (profiled) in place of cuDNN timed alone.
    own = step_bound(row, 20.0, heads, head_dim, index_heads, index_dim, hidden, tokens, 5.0)
    assert math.isclose(own["bound_ms"], 20.0 - 5.0 + 0.5 + (scoring + projection) / 2)
    assert own["bound_attention_from"] == "dense step"


def test_kernel_parts_name_every_project_kernel_once():
    from layer_bench.kernels import project_kernel_parts, split_by_part

    parts = project_kernel_parts()
    expected = {"_select_kernel": "selection", "_fwd_kernel": "sparse forward",
                "_fwd_union_kernel": "sparse forward", "_dq_kernel": "sparse dq",
                "_dq_union_kernel": "sparse dq", "_dkdv_kernel": "sparse dk/dv",
                "_dkdv_sm90_kernel": "sparse dk/dv", "_sparse_kl_dq_kernel": "indexer loss",
                "_block_scores_kernel": "indexer loss", "_recall_kernel": "recall",
                "_rope_kernel": "norm/rope", "_rms_fwd_kernel": "norm/rope"}
    assert {name: parts.get(name) for name in expected} == expected
    split = split_by_part([("_dq_kernel", 4.0, 1), ("_dq_union_kernel", 1.0, 1),
                           ("nvjet_sm90_tst_192x192", 10.0, 3), ("cudnn_generated_fort", 2.0, 1),
                           ("void at::native::elementwise_kernel", 0.5, 7)], parts)
    assert split["step_kernel_ms"] == {"sparse dq": 5.0, "dense attention": 2.0, "gemm": 10.0,
                                       "other": 0.5}
    assert [k["name"] for k in split["project_kernels"]] == ["_dq_kernel", "_dq_union_kernel"]


def test_profile_traces_of_packed_and_one_document_rows_are_kept_apart(tmp_path):
    # Rows of the same length, one document and packed: each profiled step gets its own trace.
    traces = tmp_path / "traces"
    proc = _run(tmp_path, "--tokens", "128,128:64", "--cases", "msa_sparse_loss",
                "--no-attention-rows", "--profile", "--profile-top", "2", "--trace", str(traces),
                "--no-pair-rate")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "layer.json").read_text())["rows"]
    # --no-pair-rate: the MSA rows keep their selection statistics, without the pair rate.
    assert all("union_mean" in row and not set(PAIR_FIELDS) & set(row) for row in rows), rows
    assert sorted(p.name for p in traces.iterdir()) == [
        "msa_sparse_loss_128.json", "msa_sparse_loss_128_mean64.json"]


def test_deterministic_rows_drop_the_cudnn_rows(tmp_path):
    """--deterministic (ADR 0050): the rows run under torch's deterministic algorithms with
    Megatron's deterministic_mode; cuDNN's attention rows and pair rate are left out."""
    proc = _run(tmp_path, "--tokens", "64", "--cases", "dense,msa_sparse_loss",
                "--deterministic")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--deterministic: no cuDNN attention rows and no pair rate" in proc.stdout + proc.stderr
    result = json.loads((tmp_path / "layer.json").read_text())
    assert result["deterministic"] is True
    assert [(r["case"], r["status"]) for r in result["rows"]] == [("dense", "ok"),
                                                                  ("msa_sparse_loss", "ok")]
    assert not any(set(PAIR_FIELDS) & set(r) for r in result["rows"])
