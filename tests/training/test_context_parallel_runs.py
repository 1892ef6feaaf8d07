"""Context-parallel training end to end on gloo (CPU, reference backend), each job's ranks
running scripts/pretrain.py's ``main()`` with torchrun's environment in forked processes
(``_runs.pretrain_ranks``).

The reference is the session's CP=1 run of the small recipe (tests/training/conftest.py: 6
steps, 2 of dense warm-up, checkpoints at 3 and 6). CP=2 from scratch must follow its loss
and gradient-norm curve within fp32 tolerance, and its checkpoint must resume at CP=1; TP2 x CP2
and PP2 x VPP2 x CP2 (every virtual stage sharing one CP layout per microbatch) continue the
reference from its iteration-3 checkpoint and end with an evaluation that gives one process's
validation losses (the forward-only schedule, interleaved under PP); their own checkpoints (TP
shards, virtual stages) resume in one process on the reference curve.

The pipeline runs with CP (4 processes each, the costliest here) are the interleaved schedule's:
the CP split of a microbatch is the same code under either schedule, and the non-interleaved
1F1B schedule runs the trainer end to end in test_restart.py's two-rank PP=2 job (killed,
resumed bit for bit).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _runs import SMALL, copy_checkpoint, losses, pretrain_ranks, train

from nemo_msa.training.checkpoint_integrity import latest_iteration

# One xdist worker runs the whole module: its module-scoped runs then happen once (ADR 0038).
pytestmark = pytest.mark.xdist_group("context_parallel_runs")

SCHEDULE = ["train.train_iters=6", "model.msa_dense_warmup_steps=2"]


def _run_ranks(nproc: int, overrides: list[str], out: Path, layout: str) -> list[dict]:
    proc = pretrain_ranks(nproc, [*SMALL, *SCHEDULE, "logger.plot=false",
                                  f"checkpoint.save={out}", *overrides])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"layout TPxPPxVPPxDP : {layout}" in proc.stdout
    assert "context parallel    : 2" in proc.stdout
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _reference_rows(ref_root: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (ref_root / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows}


def _assert_follows(rows: list[dict], want: dict[int, dict], iterations: list[int]) -> None:
    got = {r["iteration"]: r for r in rows}
    assert sorted(got) == iterations
    for it in iterations:
        for key in ("loss", "grad_norm", "indexer_loss", "recall"):
            assert got[it][key] == pytest.approx(want[it][key], rel=1e-5), (it, key)
    # Every CP rank sums its share of the loss tokens: the global count, as at CP = 1.
    assert all(got[it]["tokens_in_loss"] == want[it]["tokens_in_loss"] for it in iterations)


@pytest.mark.slow
def test_cp2_follows_cp1_and_its_checkpoint_resumes_at_cp1(reference, tmp_path):
    ref_root, ref = reference
    want = _reference_rows(ref_root)
    out = tmp_path / "cp2"
    rows = _run_ranks(2, ["model.context_parallel_size=2", "checkpoint.save_interval=3"], out,
                     "1x1x1x1")
    _assert_follows(rows, want, [1, 2, 3, 4, 5, 6])
    assert [r["phase"] for r in rows] == ["dense-warmup"] * 2 + ["sparse"] * 4
    # The CP=2 checkpoint of iteration 3 resumes in one process (CP=1) on the reference curve.
    copy_checkpoint(out, 3, tmp_path / "cp1")
    resumed = train([*SCHEDULE, f"checkpoint.save={tmp_path / 'cp1'}"])
    got, ref_losses = losses(resumed["history"]), losses(ref["history"])
    for it in (4, 5, 6):
        assert got[it] == pytest.approx(ref_losses[it], rel=1e-5), it


#: Two steps from the reference's iteration-3 checkpoint, then the final evaluation (2 batches).
CONTINUE = ["train.exit_interval=2", "train.eval_interval=3", "train.eval_iters=2"]


@pytest.fixture(scope="module")
def one_process_evaluation(reference, tmp_path_factory) -> dict:
    """The metrics row of iteration 5 of ``CONTINUE`` in this process (CP = 1, no pipeline)."""
    ref_root, _ = reference
    root = tmp_path_factory.mktemp("one")
    copy_checkpoint(ref_root, 3, root)
    summary = train([*SCHEDULE, *CONTINUE, f"checkpoint.save={root}"])
    rows = {r["iteration"]: r for r in _reference_rows(root).values() if "val_loss" in r}
    assert sorted(rows) == [5] and summary["val loss"] == rows[5]["val_loss"]
    return rows[5]


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "layout"),
                         [(["model.tensor_model_parallel_size=2"], "2x1x1x1"),
                          (["model.pipeline_model_parallel_size=2",
                            "model.virtual_pipeline_model_parallel_size=2"], "1x2x2x1")],
                         ids=["tp2xcp2", "pp2xvpp2xcp2"])
def test_four_process_layouts_with_cp2_follow_cp1(reference, one_process_evaluation, tmp_path,
                                                  overrides, layout):
    ref_root, ref = reference
    start = tmp_path / "start"
    copy_checkpoint(ref_root, 3, start)
    rows = _run_ranks(4, [*overrides, "model.context_parallel_size=2", *CONTINUE,
                         f"checkpoint.load={start}"], tmp_path / "out", layout)
    _assert_follows(rows, _reference_rows(ref_root), [4, 5])
    # Rank 0's MSA layers (in two virtual chunks under VPP) shared one layout per microbatch.
    assert all(r["layouts_per_microbatch"] == 1.0 for r in rows), rows
    # The evaluation (no gradients, its own schedule) gives one process's validation losses.
    evaluated = [r for r in rows if "val_loss" in r]
    assert [r["iteration"] for r in evaluated] == [5]
    want = {k: v for k, v in one_process_evaluation.items() if k.startswith("val_loss")}
    assert len(want) == 4  # val_loss and its three position buckets
    for key, value in want.items():
        assert evaluated[0][key] == pytest.approx(value, rel=1e-5), key
    # The layout's own checkpoint (saved at the exit, iteration 5) resumes in one process on
    # the reference curve: what the TP shards or the virtual stages wrote is the whole model.
    assert latest_iteration(tmp_path / "out") == 5
    copy_checkpoint(tmp_path / "out", 5, tmp_path / "one")
    resumed = train([*SCHEDULE, f"checkpoint.save={tmp_path / 'one'}"])
    assert "(resumed at 5)" in resumed["steps"]
    assert losses(resumed["history"])[6] == pytest.approx(losses(ref["history"])[6], rel=1e-5)
