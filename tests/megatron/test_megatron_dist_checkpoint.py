"""Distributed checkpoint of an MSA GPT saved at one tensor-parallel size, loaded at another."""

from __future__ import annotations

import pytest
from _megatron_harness import checkpoint_worker, spawn

# One xdist worker runs the whole module: its module-scoped runs then happen once (ADR 0038).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("megatron_dist_checkpoint")]

DIRECTIONS = [(2, 1), (1, 2)]


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("msa_dist_ckpt"))
    return spawn(checkpoint_worker, 2, timeout=400, directions=DIRECTIONS, path=path)


@pytest.mark.parametrize(("save_tp", "load_tp"), DIRECTIONS, ids=["tp2_to_tp1", "tp1_to_tp2"])
def test_dist_checkpoint_round_trip_across_tp(round_trips, save_tp, load_tp):
    for rank, results in sorted(round_trips.items()):
        result = results[(save_tp, load_tp)]
        saved, loaded = result["saved"], result["loaded"]
        loss_diff = max(abs(a - b) for a, b in zip(saved, loaded, strict=True))
        assert result["param_names"] and result["indexer_params"] == 12, result
        assert result["param_diff"] == 0.0 and loss_diff < 1e-5, (
            f"rank {rank}: saved at TP={save_tp}, loaded at TP={load_tp}: max |param diff| "
            f"{result['param_diff']:.2e}, losses {saved} vs {loaded} (max diff {loss_diff:.2e})"
        )
        print(
            f"[parity] rank {rank} TP={save_tp} -> TP={load_tp}: max |param diff| "
            f"{result['param_diff']:.2e}, max |loss diff| {loss_diff:.2e}"
        )
        assert result["before_diff"] > 0, (
            f"rank {rank}: the fresh model's indexer must differ before loading "
            f"(smallest max |diff| {result['before_diff']:.2e})"
        )
