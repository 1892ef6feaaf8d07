"""benchmarks/indexer_regime.py: tile-union statistics of a trained MSA model's own selections."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _runs import SMALL, train

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_union_statistics_of_a_trained_model_at_a_longer_length(tmp_path):
    ckpt = tmp_path / "msa"
    train(["train.train_iters=3", "model.msa_dense_warmup_steps=1", f"checkpoint.save={ckpt}"])
    regime = _script("indexer_regime")
    out = tmp_path / "regime.json"
    # Trained at 256 tokens, selections at 512 (as 8192 -> 32768 on the GPU).
    report = regime.main(["--rows", "1", "--qts", "1,4,16", "--cap", "3", "--out", str(out),
                          *SMALL, "model.seq_length=512", f"checkpoint.load={ckpt}",
                          "model.msa_dense_warmup_steps=1",
                          "train.global_batch_size=1"])
    assert report["iteration"] == 3 and report["phase"] == "sparse"
    assert report["seq_length"] == 512 and out.is_file()
    layers = report["layers"]
    assert sorted(layers) == [1, 2, 3, 4]  # every MSA layer of the small model
    for stats in layers.values():
        one, four, sixteen = stats[1], stats[4], stats[16]
        # A one-token tile's union is that token's own selection: no inflation, all tiles on
        # the union kernel whenever a token selects at most the cap.
        assert one["union_inflation"] == pytest.approx(1.0) and one["union_tiles"] == 1.0
        assert 1.0 <= one["union_mean"] <= 3.0
        # Larger tiles: unions grow (or stay), and so does the work inflation.
        assert one["union_mean"] <= four["union_mean"] <= sixteen["union_mean"]
        assert four["union_inflation"] >= 1.0
        assert 0.0 <= sixteen["union_exact_share"] <= 1.0
    assert set(report["mean"]) == {1, 4, 16}
    with pytest.raises(SystemExit, match="checkpoint.load"):
        regime.main([*SMALL])
