"""Tensor, sequence, pipeline and virtual-pipeline parallelism on CPU/gloo against one process.

One set of two gloo processes runs every layout in turn (the reference TP=1/PP=1 included), so
the suite pays the process start-up once. Every layout holds the same full model (weights seeded
by parameter name) and trains the same four packed microbatches through Megatron's schedule;
the indexer loss is part of every gradient.
"""

from __future__ import annotations

import pytest
import torch
from _megatron_harness import PARALLEL_LAYOUTS, spawn

# One xdist worker runs the whole module: its module-scoped runs then happen once (ADR 0038).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("megatron_parallel")]


@pytest.fixture(scope="module")
def runs():
    from _megatron_harness import parallel_suite_worker

    return spawn(parallel_suite_worker, 2, timeout=400, names=list(PARALLEL_LAYOUTS))


def _merged_grads(runs, name):
    grads = {}
    for rank in sorted(runs):
        grads.update(runs[rank][name]["grads"])
    return grads


def _losses(runs, name):
    for rank in sorted(runs):
        if runs[rank][name]["losses"]:
            return runs[rank][name]["losses"]
    raise AssertionError(f"{name}: no rank returned losses")


def _compare(runs, name, atol, reference_name="tp1"):
    reference = _merged_grads(runs, reference_name)
    grads = _merged_grads(runs, name)
    assert set(grads) == set(reference), set(grads) ^ set(reference)
    worst_name, worst = None, -1.0
    for key, ref in reference.items():
        diff = float((grads[key] - ref).abs().max())
        if diff > worst:
            worst_name, worst = key, diff
    ref_loss, losses = _losses(runs, reference_name), _losses(runs, name)
    loss_diff = max(abs(a - b) for a, b in zip(ref_loss, losses, strict=True))
    scale = max(float(g.abs().max()) for g in reference.values())
    assert loss_diff < 1e-5 and worst < atol, (
        f"{name} vs {reference_name}: max |loss diff| {loss_diff:.2e} (losses {losses} vs "
        f"{ref_loss}); max |grad diff| {worst:.2e} at {worst_name} (largest grad {scale:.2e}, "
        f"tol {atol})"
    )
    print(
        f"[parity] {name} vs {reference_name}: max |loss diff| {loss_diff:.2e}, max |grad diff| "
        f"{worst:.2e} (largest grad {scale:.2e})"
    )
    return worst


def test_tp2_matches_tp1(runs):
    _compare(runs, "tp2", atol=1e-6)


def test_tp2_matches_tp1_with_the_sparse_indexer_loss(runs):
    _compare(runs, "tp2_sparse_loss", atol=1e-6, reference_name="tp1_sparse_loss")
    dense = _merged_grads(runs, "tp1")
    sparse = _merged_grads(runs, "tp1_sparse_loss")
    name = "decoder.layers.0.self_attention.indexer.index_q_proj.weight"
    assert float((dense[name] - sparse[name]).abs().max()) > 1e-8, "the loss type must matter"


def test_pp2_matches_single_process(runs):
    _compare(runs, "pp2", atol=1e-6)


def test_pp2_vpp2_matches_single_process(runs):
    _compare(runs, "pp2_vpp2", atol=1e-6)


def test_indexer_grads_are_present_in_every_layout(runs):
    for name in ("tp1", "tp2", "pp2", "pp2_vpp2"):
        grads = _merged_grads(runs, name)
        index = {k: float(v.norm()) for k, v in grads.items() if ".indexer." in k}
        assert len(index) == 12 and min(index.values()) > 0, f"{name}: {index}"


def test_indexer_metrics_agree_across_layouts(runs):
    reference = runs[0]["tp1"]["metrics"]
    for name in ("tp2", "pp2", "pp2_vpp2"):
        for rank in sorted(runs):
            metrics = runs[rank][name]["metrics"]
            for key in ("indexer_loss", "selection_recall"):
                assert abs(metrics[key] - reference[key]) < 1e-6, (
                    f"{name} rank {rank}: {key} {metrics[key]} vs TP=1 {reference[key]}"
                )


def test_layout_built_once_per_microbatch_per_rank(runs):
    microbatches = len(_losses(runs, "tp1"))
    for name in ("tp1", "tp2", "pp2", "pp2_vpp2"):
        builds = [runs[rank][name]["builds"] for rank in sorted(runs)]
        assert builds == [microbatches] * len(runs), (
            f"{name}: MSAMicrobatch builds per rank {builds}; expected {microbatches} "
            f"(one per microbatch) on every rank"
        )
    # Negative control: without the shared data-side cache every VPP chunk gets its own batch
    # tensors, so each rank builds one layout per chunk and microbatch.
    builds = [runs[rank]["pp2_vpp2_unshared"]["builds"] for rank in sorted(runs)]
    assert builds == [2 * microbatches] * len(runs), builds
    assert _compare(runs, "pp2_vpp2_unshared", atol=1e-6) < 1e-6
    assert torch.distributed.is_available()


def test_sequence_parallel_matches_tp2_without_it(runs):
    """SP at TP=2: the indexer gathers the sequence itself; outputs and gradients unchanged."""
    for rank in sorted(runs):
        result = runs[rank]["sequence_parallel"]
        assert result["indexer_grads"] == 4, result
        relative = result["grad_diff"] / result["grad_scale"]
        assert result["out_diff"] < 1e-6 and relative < 1e-6, (
            f"rank {rank}: SP vs no SP at TP=2: max |out diff| {result['out_diff']:.2e} (output "
            f"scale {result['out_scale']:.2e}), max |grad diff| {result['grad_diff']:.2e} "
            f"(largest grad {result['grad_scale']:.2e}, relative {relative:.2e}), indexer grads "
            f"{result['indexer_grad_diff']:.2e}"
        )


def test_pp2_vpp2_full_recompute_replays_the_selection_bitwise(runs):
    """Full recompute under the interleaved schedule (ADR 0028): each layer holds several
    microbatches' selections at once and each recompute takes its own: the same losses, metrics
    and gradients bit for bit, one scoring per MSA layer and microbatch, one layout per
    microbatch, nothing left after the step."""
    plain, recomputed = "pp2_vpp2", "pp2_vpp2_full_recompute"
    assert _losses(runs, recomputed) == _losses(runs, plain)
    reference, grads = _merged_grads(runs, plain), _merged_grads(runs, recomputed)
    assert set(grads) == set(reference)
    for key, ref in reference.items():
        assert torch.equal(grads[key], ref), (key, float((grads[key] - ref).abs().max()))
    microbatches = len(_losses(runs, plain))
    for rank in sorted(runs):
        a, b = runs[rank][plain], runs[rank][recomputed]
        assert a["metrics"] == b["metrics"], rank
        assert b["selections"] == a["selections"] and b["builds"] == microbatches, (rank, a, b)
        assert b["pending_replay"] == 0 and b["max_in_flight"] > 1, (rank, b)
        assert a["max_in_flight"] == 0, (rank, a)
    assert sum(runs[rank][recomputed]["selections"] for rank in runs) == 3 * microbatches
