"""Context parallelism of MSA layers on CPU/gloo: a GPTModel at CP=2 against CP=1.

Two gloo processes run each variant (dense indexer loss, sparse by-product loss, dense warm-up)
at CP=2 and then at CP=1 (the two ranks as data-parallel replicas). The CP run gets Megatron's
load-balanced split of tokens, labels and positions; its document map is the global ids in the
first microbatch and each rank's local ids in the second (gathered once by the layout). The
contract: the same per-token LM losses, the same gradient of every parameter (summed over the CP
group, as Megatron's gradient all-reduce over data x context does), the same indexer loss and
selection recall. Megatron issue #5643 (an indexer with zero gradient under CP) is checked
explicitly: index_k's gradient arrives through the reduce-scatter.
"""

from __future__ import annotations

import pytest
import torch
from _megatron_harness import CP_VARIANTS, several_workers, spawn

from nemo_msa.context_parallel import split_for_context_parallel

# One xdist worker runs the whole module: its module-scoped runs then happen once (ADR 0038).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("megatron_context_parallel")]


@pytest.fixture(scope="module")
def two_ranks():
    """The CP variants and the THD checks, in one spawn of two ranks."""
    return spawn(several_workers, 2, timeout=500, jobs={
        "cp": ("context_parallel_worker", {"variants": list(CP_VARIANTS)}),
        "thd": ("thd_worker", {})})


@pytest.fixture(scope="module")
def runs(two_ranks):
    return {rank: result["cp"] for rank, result in two_ranks.items()}


@pytest.mark.parametrize("name", list(CP_VARIANTS))
def test_cp2_matches_cp1(runs, name):
    _check_cp_against_reference(runs, name, 2)


def test_cp2_full_recompute_replays_the_selection_bitwise(runs):
    """Full recompute at CP = 2 (ADR 0028): the recompute takes back the layout (no second
    gather of the document map) and this rank's selection: the same per-token losses, gradients
    and metrics as CP = 2 without recompute, bit for bit, one scoring per MSA layer and
    microbatch."""
    for rank, result in runs.items():
        plain = result[("sparse_loss", 2)]
        recomputed = result[("sparse_loss_full_recompute", 2)]
        assert recomputed["losses"] == plain["losses"], rank
        for out, ref in zip(recomputed["per_token"], plain["per_token"], strict=True):
            assert torch.equal(out, ref), rank
        for key, ref in plain["grads"].items():
            assert torch.equal(recomputed["grads"][key], ref), (rank, key)
        assert recomputed["metrics"] == plain["metrics"], rank
        assert recomputed["selections"] == plain["selections"] == 3 * 2, rank
        assert recomputed["builds"] == [1, 1] and recomputed["pending_replay"] == 0, rank


@pytest.fixture(scope="module")
def tp2_cp2_runs():
    from _megatron_harness import context_parallel_worker

    return spawn(context_parallel_worker, 4, timeout=500, variants=["sparse_loss"], tp=2)


def test_tp2_cp2_matches_tp1_cp1(tp2_cp2_runs):
    """TP=2 x CP=2 (4 processes): KV and index heads split over TP, index_k replicated over TP
    (its gradient all-reduced there) and gathered over CP (reduce-scattered back)."""
    _check_cp_against_reference(tp2_cp2_runs, "sparse_loss", 2)


def _check_cp_against_reference(runs, name, cp_size):
    cp1, cp2 = runs[0][(name, 1)], {rank: runs[rank][(name, cp_size)] for rank in runs}
    assert max(abs(a - b) for a, b in zip(cp1["losses"], cp2[0]["losses"], strict=True)) < 1e-5
    for result in cp2.values():
        for step, per_token in enumerate(result["per_token"]):
            expected = split_for_context_parallel(
                cp1["per_token"][step], 1, cp_size, result["cp_rank"])
            torch.testing.assert_close(per_token, expected, rtol=1e-4, atol=1e-5)
    grads1, grads2 = cp1["grads"], cp2[0]["grads"]
    assert set(grads1) == set(grads2)
    for key, ref in grads1.items():
        assert torch.isfinite(grads2[key]).all(), key
        err = float((grads2[key] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 1e-4 or float((grads2[key] - ref).abs().max()) < 1e-7, (key, err)
    # Issue #5643: the indexer's key side must train under CP.
    index_k = [k for k in grads2 if "index_k_proj" in k]
    assert index_k and all(float(grads2[k].abs().sum()) > 0 for k in index_k)
    # One layout per microbatch shared by the 4 layers, from global or local (gathered) ids.
    assert all(result["builds"] == [1, 1] for result in cp2.values()), {
        rank: result["builds"] for rank, result in cp2.items()}
    m1, m2 = cp1["metrics"], cp2[0]["metrics"]
    assert set(m1) == set(m2) and "selection_recall" in m1 and "indexer_loss" in m1
    for key, value in m1.items():
        assert abs(m2[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, m2[key], value)


@pytest.fixture(scope="module")
def thd_runs(two_ranks):
    return {rank: result["thd"] for rank, result in two_ranks.items()}


@pytest.mark.parametrize("cp", [1, 2])
def test_thd_input_matches_bshd(thd_runs, cp):
    """The same documents as THD input (sequences padded to multiples of 4, Megatron's
    PackedSeqParams) and as one BSHD row: the same per-token losses and gradients."""
    bshd, thd = thd_runs[0][("bshd", 1)], thd_runs[0][("thd", cp)]
    torch.testing.assert_close(thd["per_token"], bshd["per_token"], rtol=1e-4, atol=1e-5)
    for key, ref in bshd["grads"].items():
        err = float((thd["grads"][key] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 1e-4 or float((thd["grads"][key] - ref).abs().max()) < 1e-7, (key, err)


def test_the_gather_is_differentiable_with_a_reduce_scatter_backward(thd_runs):
    """Forward: every rank holds the global tensor; backward: each rank's local rows get the sum
    over ranks of the gathered tensor's gradient (gloo: all-reduce + slice)."""
    for rank, result in thd_runs.items():
        assert result["gather"]["forward_error"] == 0.0, rank
        assert result["gather"]["grad_error"] < 1e-12, rank
