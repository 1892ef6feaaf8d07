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
                          "--probe-rows", "1",
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
    # The made-up selections on the same rows: a one-token tile is exact for both; shared
    # per block, the tiles inside a block add nothing to a token's own selection.
    synthetic = report["synthetic"]
    for name in ("random", "block_shared"):
        assert synthetic[name][1]["union_inflation"] == pytest.approx(1.0)
    assert synthetic["block_shared"][4]["union_mean"] == pytest.approx(
        synthetic["block_shared"][1]["union_mean"])
    assert synthetic["random"][16]["union_mean"] >= synthetic["block_shared"][16]["union_mean"]
    # The passkey diagnosis: one row per depth bucket, shares in [0, 1], every MSA layer.
    needle = report["passkey_needle"]
    assert set(needle["buckets"]) == {"passkey/depth_0-10", "passkey/depth_25",
                                      "passkey/depth_50", "passkey/depth_75",
                                      "passkey/depth_90-100"}
    for entry in needle["buckets"].values():
        assert entry["rows"] == 1
        assert 0.0 <= entry["selected"] <= entry["selected_any"] <= 1.0
        assert 0.0 < entry["chance"] <= 1.0
    assert sorted(needle["layers"]) == [1, 2, 3, 4]
    with pytest.raises(SystemExit, match="checkpoint.load"):
        regime.main([*SMALL])


def test_synthetic_selections_hold_the_own_block_and_distinct_earlier_ones():
    import torch

    regime = _script("indexer_regime")
    # Two documents of 40 and 24 tokens, blocks of 8, top-3.
    documents = torch.tensor([0] * 40 + [1] * 24)
    positions = torch.cat([torch.arange(40), torch.arange(24)])
    for shared in (False, True):
        q2k = regime.synthetic_selection(documents, positions, 8, 3, 2, shared,
                                         torch.Generator().manual_seed(0))
        assert q2k.shape == (2, 64, 3)
        own = positions // 8
        assert torch.equal(q2k[:, :, 0], own.expand(2, -1))
        for h in range(2):
            for t in range(64):
                free = [b for b in q2k[h, t, 1:].tolist() if b >= 0]
                assert len(free) == min(2, int(own[t])) and len(set(free)) == len(free)
                assert all(b < own[t] for b in free)
        same_block = (documents[:, None] == documents[None]) & (own[:, None] == own[None])
        agree = (q2k[:, :, None, :] == q2k[:, None, :, :]).all(-1)
        assert bool(agree[:, same_block].all()) == shared
