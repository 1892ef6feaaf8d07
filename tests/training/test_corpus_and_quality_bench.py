"""scripts/prepare_corpus.py builds a dataset Megatron reads back; quality_bench.py runs tiny."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

# One xdist worker runs the whole module: its module-scoped runs then happen once (ADR 0038).
pytestmark = pytest.mark.xdist_group("corpus_and_quality_bench")

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


def test_passkey_and_mqar_documents_plant_what_the_probes_ask(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from nemo_msa.training.probes import MQAR_KEY_TOKENS, MQAR_VALUE_TOKENS
    from nemo_msa.training.recipe_schema import TrainConfig

    prep = _script("prepare_corpus")
    # The corpus plants what the evaluation's default probe keys ask for.
    defaults = TrainConfig()
    assert defaults.eval_probe_markers == [prep.PASSKEY_MARKER, prep.MQAR_MARKER]
    assert tuple(defaults.eval_probe_token_range) == prep.KEY_RANGE
    assert (prep.MQAR_KEY_BYTES, prep.MQAR_VALUE_BYTES) == (MQAR_KEY_TOKENS, MQAR_VALUE_TOKENS)
    src = tmp_path / "src"
    src.mkdir()
    texts = {f"m{i}.py": f"# m\u00f6dule {i}\n" + "".join(f"v{j} = {i * j}\n"
                                                        for j in range(30 + i))
             for i in range(30)}
    for name, text in texts.items():
        (src / name).write_text(text)
    (src / "soh.py").write_bytes(b"x = '\x01'\n")  # holds the passkey marker: dropped
    assert prep.main(["--source", str(src), "--out", str(tmp_path / "out"),
                      "--passkey-fraction", "0.4", "--mqar-fraction", "0.4",
                      "--passkey-length", "6", "--mqar-pairs", "3"]) == 0
    ds = IndexedDataset(str(tmp_path / "out" / prep.PREFIX_NAME))
    docs = [bytes(ds[i][:-1].astype(np.uint8)) for i in range(len(ds))]
    assert len(docs) == len(texts)
    kinds = {n: prep.retrieval_kind(f"0:{n}", 0.4, 0.4) for n in texts}
    assert {"passkey", "mqar", None} == set(kinds.values())  # a real mix at these shares
    for name, text in texts.items():
        data = text.encode()
        kind = kinds[name]
        if kind is None:
            assert data in docs
            continue
        doc = next(d for d in docs if _unplant(d) == data)
        if kind == "passkey":
            needle = doc[-7:]
            assert needle[0] == 1 and all(65 <= b < 91 for b in needle[1:])
            first = doc.index(needle)
            assert first < len(doc) - 7 and doc.count(b"\x01") == 2
            assert doc[:first] + doc[first + 7:-7] == data
            assert (doc[:first] + doc[first + 7:]).decode("utf-8")  # planted at a char start
        else:
            starts = [i for i, b in enumerate(doc) if b == 2]
            items = [doc[i:i + 5] for i in starts]
            assert len(items) == 6 and len({it[1:3] for it in items}) == 3  # distinct keys
            pairs, queries = items[:3], items[3:]
            assert sorted(pairs) == sorted(queries)  # every pair asked once, after all pairs
            # Pairs in the text's first three quarters, queries in its last (in the text's
            # coordinates; each earlier insertion shifts a position by 5 bytes).
            cut = 3 * len(data) // 4
            assert max(starts[:3]) < cut + 10 and min(starts[3:]) >= cut + 15
    # The same call on another machine builds the same corpus (hash-seeded draws).
    assert prep.main(["--source", str(src), "--out", str(tmp_path / "again"),
                      "--passkey-fraction", "0.4", "--mqar-fraction", "0.4",
                      "--passkey-length", "6", "--mqar-pairs", "3"]) == 0
    again = IndexedDataset(str(tmp_path / "again" / prep.PREFIX_NAME))
    assert [bytes(again[i][:-1].astype(np.uint8)) for i in range(len(again))] == docs
    assert prep.main(["--source", str(src), "--out", str(tmp_path / "x"),
                      "--passkey-fraction", "0.7", "--mqar-fraction", "0.4"]) == 2


def _unplant(doc: bytes) -> bytes:
    """A planted document without its passkey needles or MQAR items (marker + 5 or 4 bytes)."""
    out, i = bytearray(), 0
    passkey_len = 6
    while i < len(doc):
        if doc[i] == 1:
            i += 1 + passkey_len
        elif doc[i] == 2:
            i += 5
        else:
            out.append(doc[i])
            i += 1
    return bytes(out)


def test_probe_gaps_judge_msa_against_dense_at_every_passkey_depth():
    bench = _script("quality_bench")
    msa = {"probe/passkey_acc/depth_25": 0.90, "probe/passkey_acc/depth_75": 0.97,
           "probe/mqar_acc/dist_0-25": 0.10, "probe/passkey_loss/depth_25": 1.0}
    dense = {"probe/passkey_acc/depth_25": 0.94, "probe/passkey_acc/depth_75": 0.95,
             "probe/mqar_acc/dist_0-25": 0.50}
    got = bench.probe_gaps({"msa": msa, "dense": dense, "control": {}})
    assert got["probe_msa_minus_dense_points"] == pytest.approx(
        {"probe/passkey_acc/depth_25": -4.0, "probe/passkey_acc/depth_75": 2.0,
         "probe/mqar_acc/dist_0-25": -40.0})
    assert got["msa_within_5_points"]  # the MQAR gap is reported, the verdict is per depth
    msa["probe/passkey_acc/depth_25"] = 0.88
    assert not bench.probe_gaps({"msa": msa, "dense": dense})["msa_within_5_points"]
    assert bench.probe_gaps({"msa": msa}) == {}


def test_quality_bench_runs_equal_steps_resumes_arms_and_evaluates_longer_rows(
        corpus, tmp_path, monkeypatch):
    bench = _script("quality_bench")
    args = ["--tiny", "--corpus", str(corpus), "--out", str(tmp_path), "--arms", "msa,dense",
            "--steps", "4", "--probes", "passkey,mqar", "--extrapolate-to", "512",
            "--final-probe-rows", "2", "--time-budget-s", "300"]
    # First call: each arm stops at step 2 (as the time guard would stop it).
    first = bench.main([*args, "train.exit_interval=2"])
    for arm in ("msa", "dense"):
        run = first["lengths"]["256"]["runs"][arm]
        assert run["steps"] == 2 and run["stopped_early"] and run["target_steps"] == 4
        assert bench.finished_steps(tmp_path / "seq256" / arm) == 2
    assert "256_at_512" not in first["lengths"]  # not trained to the end: not extrapolated
    with pytest.raises(SystemExit) as finished:
        bench.main([*args, "--finished"])
    assert finished.value.code == 1
    assert "msa stopped at step 2 of 4" in (tmp_path / "quality.md").read_text()
    before = {arm: bench.read_metrics(tmp_path / "seq256" / arm / "metrics.jsonl")
              for arm in ("msa", "dense")}
    # Second call: the arms continue from their checkpoints to step 4, then the 512 rows.
    second = bench.main(args)
    block = second["lengths"]["256"]
    for arm in ("msa", "dense"):
        rows = bench.read_metrics(tmp_path / "seq256" / arm / "metrics.jsonl")
        assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
        assert rows[:2] == before[arm]  # steps 1-2 were not run again
        run = block["runs"][arm]
        assert run["steps"] == 4 and not run["stopped_early"]
        assert [c[0] for c in run["val_curve"]] == [2, 4]
        assert 0.0 <= run["probes"]["probe/passkey_acc/depth_50"] <= 1.0
        longer = second["lengths"]["256_at_512"]["runs"][arm]
        assert longer["steps"] == 4 and math.isfinite(longer["final_val_loss"])
        # The 512-token rows' buckets (this corpus's documents are ~100 tokens long).
        assert {"pos_0-32", "pos_32-128"} <= set(longer["buckets"]) <= {
            "pos_0-32", "pos_32-128", "pos_128-512"}
        assert "probe/mqar_acc" in longer["probes"]
        # One skip_train evaluation of the checkpoint of step 4, no training step.
        longer_rows = bench.read_metrics(tmp_path / "seq256_at512" / arm / "metrics.jsonl")
        assert longer_rows[-1]["skip_train"] and longer_rows[-1]["iteration"] == 4
    with pytest.raises(SystemExit) as finished:
        bench.main([*args, "--finished"])
    assert finished.value.code == 0
    cmp_ = block["comparison"]
    assert cmp_["equal_step"] == 4 and "msa_within_5_points" in cmp_
    assert set(cmp_["arms"]["msa"]["probes_at_equal_step"]) == set(block["runs"]["msa"]["probes"])
    text = (tmp_path / "quality.md").read_text()
    assert "Retrieval probes" in text and "trained at 256 tokens, evaluated at 512" in text
    # Third call: everything is done; nothing trains or evaluates again.
    monkeypatch.setattr(bench, "run_arm", lambda *a: pytest.fail("ran an arm again"))
    third = bench.main(args)
    assert third["lengths"]["256"]["runs"]["msa"]["steps"] == 4
    assert third["lengths"]["256_at_512"]["runs"]["dense"]["final_val_loss"] == \
        second["lengths"]["256_at_512"]["runs"]["dense"]["final_val_loss"]
    # A call that only evaluates, in a process that has trained nothing (no iteration known yet,
    # as on the device, where each call is a new process): the MSA arm evaluates as before.
    from nemo_msa.megatron import set_training_iteration

    monkeypatch.undo()
    shutil.rmtree(tmp_path / "seq256_at512" / "msa")
    set_training_iteration(None)
    fourth = bench.main([*args, "--arms", "msa"])
    assert fourth["lengths"]["256_at_512"]["runs"]["msa"]["final_val_loss"] == \
        second["lengths"]["256_at_512"]["runs"]["msa"]["final_val_loss"]
