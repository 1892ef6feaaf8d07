"""scripts/prepare_corpus.py builds a dataset Megatron reads back; quality_bench.py runs tiny."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A corpus from this repository's own package sources (real text, a few hundred KB)."""
    out = tmp_path_factory.mktemp("corpus")
    assert _script("prepare_corpus").main(
        ["--source", str(REPO / "nemo_msa"), "--out", str(out), "--max-mb", "0.6",
         "--copy-fraction", "1", "--copy-kb", "0.05"]) == 0
    return out / "pycode_text_document"


def test_corpus_builds_from_a_few_files_and_megatron_reads_it_back(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    texts = {"a.py": "print('a')\n", "pkg/b.py": "x = 'h\u00e9llo'\n" * 3, "c.py": "pass\n"}
    for name, text in texts.items():
        (src / name).write_text(text, encoding="utf-8")
    (src / "dup.py").write_text(texts["c.py"])              # same bytes: kept once
    (src / "latin.py").write_bytes(b"x = '\xe9'\n")            # not UTF-8: skipped
    (src / "notes.txt").write_text("not python")              # not *.py: skipped
    prep = _script("prepare_corpus")
    assert prep.main(["--source", str(src), "--out", str(tmp_path / "out")]) == 0
    ds = IndexedDataset(str(tmp_path / "out" / prep.PREFIX_NAME))
    docs = [bytes(ds[i][:-1].astype(np.uint8)) for i in range(len(ds))]
    assert all(int(ds[i][-1]) == prep.EOD for i in range(len(ds)))
    assert ds[0].dtype == np.uint16 and len(ds) == 3
    want = {t.encode("utf-8") for t in texts.values()}
    assert set(docs) == want
    # The order is the hash of the relative path, not the walk order.
    assert prep.main(["--source", str(src), "--out", str(tmp_path / "again")]) == 0
    again = IndexedDataset(str(tmp_path / "again" / prep.PREFIX_NAME))
    assert [bytes(again[i][:-1].astype(np.uint8)) for i in range(len(again))] == docs
    assert prep.main(["--source", str(src / "missing"), "--out", str(tmp_path)]) == 2


def test_the_training_loader_reads_the_corpus(corpus):
    from nemo_msa.training.data import build_gpt_datasets
    from nemo_msa.training.recipe import load_recipe

    recipe = load_recipe(None, [f"dataset.data_path=[{corpus}]", "model.vocab_size=257",
                                "model.seq_length=128", "dataset.split=90,10,0"])
    train, valid = build_gpt_datasets(recipe.dataset, recipe.gpt, 1, 16, 8)
    for ds in (train, valid):
        tokens = np.concatenate([ds[i]["tokens"].numpy() for i in range(8)])
        assert tokens.max() <= 256 and len(tokens) == 8 * 128
        # Python source: mostly printable ASCII.
        assert ((tokens >= 32) & (tokens < 127) | (tokens == 10)).mean() > 0.9


def test_quality_bench_runs_tiny_and_reports_every_arm(corpus, tmp_path):
    bench = _script("quality_bench")
    report = bench.main(["--tiny", "--corpus", str(corpus), "--out", str(tmp_path),
                         "--time-budget-s", "300", "--copy-marker", "0"])
    block = report["lengths"]["256"]
    assert set(block["runs"]) == {"msa", "dense", "control"}
    for arm, run in block["runs"].items():
        assert run["steps"] == 4 and [c[0] for c in run["val_curve"]] == [2, 4]
        assert math.isfinite(run["final_val_loss"]) and len(run["buckets"]) == 4
        assert math.isfinite(run["buckets"]["copy"])
        assert (run["recall"] is None) == (arm == "dense")
        assert run["tokens_per_s"] > 0 and run["mfu"] is None
    cmp_ = block["comparison"]
    assert cmp_["equal_step"] == 4 and "control_worse" in cmp_
    assert "control_minus_best_copy" in cmp_ and math.isfinite(cmp_["msa_minus_dense_copy"])
    assert cmp_["msa_minus_dense"] == pytest.approx(
        cmp_["arms"]["msa"]["val_loss_at_equal_step"]
        - cmp_["arms"]["dense"]["val_loss_at_equal_step"])
    assert json.loads((tmp_path / "quality.json").read_text())["lengths"]["256"]["runs"]
    text = (tmp_path / "quality.md").read_text()
    assert "| control | 4 |" in text and "256 tokens per sequence" in text


def test_comparison_at_equal_steps_and_equal_time():
    bench = _script("quality_bench")
    runs = {
        "msa": {"val_curve": [(50, 10.0, 3.0), (100, 20.0, 2.0)]},
        "dense": {"val_curve": [(50, 20.0, 2.9), (100, 40.0, 1.9)]},
        "control": {"val_curve": [(50, 5.0, 3.5)]},
    }
    cmp_ = bench.compare(runs)
    assert cmp_["equal_step"] == 50 and cmp_["equal_time_s"] == 5.0
    assert cmp_["arms"]["msa"]["val_loss_at_equal_step"] == 3.0
    assert math.isnan(cmp_["arms"]["msa"]["val_loss_at_equal_time"])  # before its first eval
    assert cmp_["control_minus_best"] == pytest.approx(0.6) and cmp_["control_worse"]
    runs["control"]["val_curve"].append((100, 30.0, 1.0))
    cmp_ = bench.compare(runs)
    assert cmp_["equal_step"] == 100 and cmp_["equal_time_s"] == 20.0
    assert cmp_["arms"]["dense"]["val_loss_at_equal_time"] == pytest.approx(2.9)
    assert cmp_["arms"]["control"]["val_loss_at_equal_time"] == pytest.approx(3.5 - 2.5 * 0.6)
    assert not cmp_["control_worse"]
    with pytest.raises(ValueError, match="arm='sparse'"):
        bench.arm_overrides("sparse", 4)


def test_copy_documents_are_the_marked_head_twice_chosen_by_name(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = tmp_path / "src"
    src.mkdir()
    texts = {f"m{i}.py": f"# module {i}\n" + "".join(f"v{j} = {i * j}\n" for j in range(40 + i))
             for i in range(24)}
    for name, text in texts.items():
        (src / name).write_text(text)
    (src / "nul.py").write_bytes(b"x = 1\x00\n")  # holds the marker: dropped
    prep = _script("prepare_corpus")
    head = 100
    assert prep.main(["--source", str(src), "--out", str(tmp_path / "rep"),
                      "--copy-fraction", "0.5", "--copy-kb", str(head / 1e3)]) == 0
    ds = IndexedDataset(str(tmp_path / "rep" / prep.PREFIX_NAME))
    docs = {bytes(ds[i][:-1].astype(np.uint8)) for i in range(len(ds))}
    assert len(docs) == len(texts)
    copied = [n for n in texts if prep.is_copy_document(f"0:{n}", 0.5)]
    assert 0 < len(copied) < len(texts)  # a real mix at this fraction
    mark = bytes([prep.COPY_MARKER])
    for name, text in texts.items():
        data = text.encode()
        want = (mark + data[:head]) * 2 if name in copied else data
        assert want in docs, name
    assert prep.main(["--source", str(src), "--out", str(tmp_path / "x"),
                      "--copy-fraction", "1.5"]) == 2


def test_copy_loss_covers_exactly_the_tokens_after_the_second_marker():
    from nemo_msa.training.evaluate import after_second_marker, positions_from_document_ids

    ids = torch.tensor([[1] * 6 + [2] * 6, [3] * 12])
    tokens = torch.tensor([[0, 5, 0, 5, 6, 0, 7, 0, 8, 0, 9, 9],
                           [4, 0, 4, 4, 0, 4, 4, 0, 1, 2, 3, 0]])
    got = after_second_marker(tokens, positions_from_document_ids(ids), 0)
    want = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1],
                         [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(got, want)
