"""benchmarks/attention_work.py (issue #28's attention work and its floor at the GPU's peak)
against brute force, and end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_work import document_pairs, row_work  # noqa: E402
from layer_bench.rows import parse_rows  # noqa: E402

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)


def _brute(length: int, block: int, top_k: int) -> tuple[int, int]:
    """Per query, the visible keys of each visible block; MSA keeps its own block and at most
    top_k - 1 others, at best the fullest."""
    dense = sparse = 0
    for p in range(length):
        keys = [min(block, p + 1 - b * block) for b in range(p // block + 1)]
        dense += sum(keys)
        sparse += keys[-1] + sum(sorted(keys[:-1], reverse=True)[:top_k - 1])
    return dense, sparse


@pytest.mark.parametrize("length,block,top_k", [(1, 4, 2), (7, 4, 2), (8, 4, 2), (9, 4, 2),
                                                (37, 4, 3), (100, 8, 4), (33, 16, 1)])
def test_document_pairs_match_brute_force(length, block, top_k):
    assert document_pairs(length, block, top_k) == _brute(length, block, top_k)


def test_short_document_is_dense():
    # Up to top_k blocks, MSA attends every visible key: the selection is the whole causal mask.
    dense, sparse = document_pairs(2048, 128, 16)
    assert sparse == dense
    dense, sparse = document_pairs(2049, 128, 16)
    # The query at 2048 sees 17 blocks: its own (one key) and 15 of the 16 full ones.
    assert sparse == dense - 128


def test_packed_row_sums_its_documents():
    one = row_work(4096, 0, block=16, top_k=4)
    assert one["documents"] == 1
    assert (one["dense_pairs"], one["sparse_pairs"]) == document_pairs(4096, 16, 4)
    packed = row_work(4096, 512, doc_min=64, doc_maps=3, block=16, top_k=4)
    assert packed["documents"] > 1
    # Packing cuts the dense pairs far more than the sparse ones (short documents are dense).
    assert packed["dense_pairs"] < one["dense_pairs"] / 4
    assert one["sparse_pairs"] / 2 < packed["sparse_pairs"] <= one["sparse_pairs"]


def test_rows_are_bench_layers():
    # attention_work.py reads --tokens with bench_layer.py's parser (layer_bench.rows).
    assert parse_rows("8192, 131072:16384", [0], "--tokens") == [(8192, 0), (131072, 16384)]
    with pytest.raises(SystemExit, match="'x:1' is not N or N:MEAN"):
        parse_rows("x:1", [0], "--tokens")
    with pytest.raises(SystemExit, match="expected N > 0"):
        parse_rows("0", [0], "--tokens")


def test_script_end_to_end(tmp_path):
    out = tmp_path / "work.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_work.py"),
                          "--tokens", "8192,32768:4096", "--tflops", "500", "--json", str(out)],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert "| 8192 | - | 1.0 |" in run.stdout
    rows = json.loads(out.read_text())
    assert [(r["tokens"], r["doc_mean"]) for r in rows] == [(8192, 0), (32768, 4096)]
    # 8192 tokens of one document at M3 shape: 14 * 64 * 128 FLOPs per pair.
    assert rows[0]["sparse_tflop"] == pytest.approx(
        document_pairs(8192, 128, 16)[1] * 14 * 64 * 128 / 1e12)
    assert rows[0]["sparse_floor_ms"] == pytest.approx(rows[0]["sparse_tflop"] / 500 * 1e3)
