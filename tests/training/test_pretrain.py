"""End-to-end training on the CPU: loss falls, resume is exact, the indexer learns.

All runs use the embedded default recipe shrunk by overrides (4 MSA layers of width 64, 256-token
rows of Megatron mock documents, 32-token blocks, top-2), so the suite stays within minutes on
2 cores. Single-process runs happen in this process (pretrain + teardown); the pipeline runs go
through torchrun with gloo processes. PP=2 on two processes against one process is
tests/training/test_restart.py's two-rank run (killed and resumed there); PP=2 x VPP=2 x CP=2
against one process is tests/training/test_context_parallel_runs.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _runs import SMALL, copy_checkpoint, losses, pretrain_ranks, train

from nemo_msa.training.checkpoint_integrity import (
    MANIFEST,
    POINTER,
    latest_iteration,
    verify_checkpoint,
)
from nemo_msa.training.recipe import RecipeError, load_recipe
from nemo_msa.training.setup import CPU_THREADS_PER_RANK, init_distributed, teardown

REPO = Path(__file__).resolve().parents[2]


def test_tiny_recipe_trains_and_loss_falls(tmp_path):
    summary = train(["train.train_iters=14", "model.msa_dense_warmup_steps=2",
                      f"logger.output_dir={tmp_path}"])
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 14
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    assert summary["attention"] == "MSA" and summary["last phase"] == "sparse"
    assert (tmp_path / "loss_curve.png").stat().st_size > 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == list(range(1, 15))


def test_resume_gives_the_same_next_losses(reference, tmp_path):
    ref_root, ref = reference
    copy_checkpoint(ref_root, 3, tmp_path)
    # An interrupted save of iteration 6 must be ignored by the resume and replaced by the next.
    (tmp_path / "iter_0000006.partial").mkdir()
    (tmp_path / "iter_0000006.partial" / "junk").write_text("half-written")
    resumed = train(["train.train_iters=6", "model.msa_dense_warmup_steps=2",
                      f"checkpoint.save={tmp_path}", "checkpoint.save_interval=3"])
    want = losses(ref["history"])
    got = losses(resumed["history"])
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # the history travels with the checkpoint
    for it in (4, 5, 6):
        assert got[it] == want[it], (it, got[it], want[it])  # bitwise on the CPU
    assert latest_iteration(tmp_path) == 6
    assert not (tmp_path / "iter_0000006.partial").exists()


def test_resume_with_a_changed_lr_follows_the_scheduler_flags(reference, tmp_path, capfd):
    """A changed optimizer.lr on resume: listed with the recipe's changes (ADR 0049) and an
    error naming the flags by default; the recipe's peak with override_opt_param_scheduler; the
    checkpoint's with use_checkpoint_..."""
    ref_root, ref = reference
    common = ["train.train_iters=6", "model.msa_dense_warmup_steps=2", "optimizer.lr=5e-3"]
    copy_checkpoint(ref_root, 3, tmp_path / "plain")
    capfd.readouterr()
    with pytest.raises(ValueError, match="optimizer.lr' = 0.005 but checkpoint .* was trained "
                       "with 0.003: pass scheduler.override_opt_param_scheduler=true"):
        train(common + [f"checkpoint.save={tmp_path / 'plain'}"])
    assert "\n  optimizer.lr: 0.003 -> 0.005\n" in capfd.readouterr().err
    # A longer run without a flag: the schedule's length differs, named the same way (its two
    # scheduler fields, decay and weight-decay steps, are one recipe key).
    with pytest.raises(RecipeError, match=r"^recipe key 'train.train_iters' = 8 but checkpoint "
                       r".*iter_0000003 was trained with 6: pass "
                       r"scheduler.override_opt_param_scheduler=true to train on with the "
                       r"recipe's value, or scheduler.use_checkpoint_opt_param_scheduler=true "
                       r"to keep the checkpoint's$"):
        train(["train.train_iters=8", "model.msa_dense_warmup_steps=2",
                f"checkpoint.save={tmp_path / 'plain'}"])
    with pytest.raises(RecipeError, match=r"^recipe keys 'optimizer.lr' = 0.005 \(checkpoint: "
                       r"0.003\), 'train.train_iters' = 8 \(checkpoint: 6\) differ from the "
                       r"schedule checkpoint .* was trained with: pass .*recipe's values"):
        train(["train.train_iters=8", "model.msa_dense_warmup_steps=2", "optimizer.lr=5e-3",
                f"checkpoint.save={tmp_path / 'plain'}"])
    want = losses(ref["history"], "lr")
    min_lr = 3.0e-4  # recipes/msa_tiny.yaml
    for flag, peak in (("override_opt_param_scheduler", 5e-3),
                       ("use_checkpoint_opt_param_scheduler", 3e-3)):
        copy_checkpoint(ref_root, 3, tmp_path / flag)
        got = losses(train(common + [f"checkpoint.save={tmp_path / flag}",
                                       f"scheduler.{flag}=true"])["history"], "lr")
        # Same step, same cosine factor: the lr above min_lr scales with the peak.
        for it in (4, 5):
            ratio = (got[it] - min_lr) / (want[it] - min_lr)
            assert ratio == pytest.approx((peak - min_lr) / (3e-3 - min_lr), rel=1e-6), (flag, it)


def test_torchrun_resume_with_another_schedule_is_one_error_line(reference, tmp_path):
    """Both ranks refuse the longer schedule; the job prints the refusal once, no traceback."""
    ref_root, _ = reference
    copy_checkpoint(ref_root, 3, tmp_path / "ckpt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(REPO / "scripts" / "pretrain.py"), *SMALL,
           "train.train_iters=8", "model.msa_dense_warmup_steps=2",
           f"checkpoint.save={tmp_path / 'ckpt'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-4000:]
    assert errors[0].startswith("error: recipe key 'train.train_iters' = 8 but checkpoint "), errors
    for key in ("scheduler.override_opt_param_scheduler=true",
                "scheduler.use_checkpoint_opt_param_scheduler=true", "trained with 6"):
        assert key in errors[0], errors[0]
    # The ranks exit with code 2 (torchrun reports them); neither prints a traceback.
    assert "exitcode  : 2" in proc.stderr and "[rank" not in proc.stderr, proc.stderr[-4000:]


def test_cpu_runs_take_one_thread_per_rank_unless_omp_num_threads_is_set(monkeypatch):
    """Issue #48: torch's default, one thread per core, oversubscribes a busy machine (5x
    slower on the shared 2-core machine); a CPU run takes CPU_THREADS_PER_RANK, and a user's
    OMP_NUM_THREADS wins; what the run found is put back at teardown."""
    assert CPU_THREADS_PER_RANK == 1
    recipe = load_recipe(None, SMALL)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for omp, want in ((None, 1), ("3", 3)):
            if omp is None:
                monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            else:
                monkeypatch.setenv("OMP_NUM_THREADS", omp)
            init_distributed(recipe)
            try:
                assert torch.get_num_threads() == want, omp
            finally:
                teardown()
            assert torch.get_num_threads() == 3  # what the run found is put back
    finally:
        torch.set_num_threads(before)


def test_pointer_to_a_missing_checkpoint_is_an_error(tmp_path):
    (tmp_path / POINTER).write_text("9\n")
    with pytest.raises(RuntimeError, match=r"names iteration 9, but .*iter_0000009 is missing"):
        latest_iteration(tmp_path)


def test_dense_warmup_trains_only_the_indexer(tmp_path):
    from megatron.core import dist_checkpointing

    summary = train(["train.train_iters=10", "model.msa_dense_warmup_steps=10",
                      f"checkpoint.save={tmp_path}", "checkpoint.save_interval=5"])
    hist = summary["history"]
    idx = [h["indexer_loss"] for h in hist]
    assert summary["last phase"] == "dense-warmup"
    assert sum(idx[-3:]) / 3 < 0.8 * sum(idx[:3]) / 3, idx
    # Between steps 5 and 10 of the warm-up only indexer weights moved.
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    try:
        early = dist_checkpointing.load_plain_tensors(str(tmp_path / "iter_0000005"))
        late = dist_checkpointing.load_plain_tensors(str(tmp_path / "iter_0000010"))
    finally:
        torch.distributed.destroy_process_group()
    weights = [k for k in early if not k.startswith("optimizer") and "_extra_state" not in k
               and isinstance(early[k], torch.Tensor)]
    indexer = [k for k in weights if ".indexer." in k]
    main = [k for k in weights if ".indexer." not in k]
    assert indexer and main
    assert all(torch.equal(early[k], late[k]) for k in main)
    assert any(not torch.equal(early[k], late[k]) for k in indexer)
    # Recall is measured in the warm-up too. It cannot rise here: a frozen random model attends
    # almost uniformly within a document, so every selection holds the same share of the mass
    # (about 0.51 for top-2 of 32-token blocks); it rises only where attention has structure.
    recall = [h["recall"] for h in hist]
    assert all(0.0 < r <= 1.0 for r in recall), recall


def test_trains_on_a_real_indexed_corpus(tmp_path):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(1)
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(60):
        doc = rng.integers(1, 200, size=int(rng.integers(20, 400))).tolist() + [255]
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    summary = train(["train.train_iters=3", "model.msa_dense_warmup_steps=1",
                      f"dataset.data_path=[{prefix}]", "dataset.eod_id=255",
                      f"dataset.path_to_cache={tmp_path / 'cache'}",
                      f"logger.output_dir={tmp_path / 'out'}"])
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 3 and all(4.0 < x < 7.0 for x in losses), losses


@pytest.mark.slow
def test_pipeline_integration_recipe_runs_on_four_gloo_processes(tmp_path):
    """recipes/msa_pp2_vpp2_tp2.yaml as shipped (TP=2 x PP=2 x VPP=2), three steps: one of
    dense warm-up, two sparse, a checkpoint at the last; four forked ranks with torchrun's
    environment (``_runs.pretrain_ranks``)."""
    proc = pretrain_ranks(4, ["--recipe", str(REPO / "recipes" / "msa_pp2_vpp2_tp2.yaml"),
                              "train.train_iters=3", "model.msa_dense_warmup_steps=1",
                              "scheduler.lr_warmup_iters=1", f"checkpoint.save={tmp_path}",
                              "checkpoint.save_interval=3", "logger.progress_bar=false"],
                          timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "layout TPxPPxVPPxDP : 2x2x2x1" in proc.stdout
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["dense-warmup"] + ["sparse"] * 2
    assert all("recall" in r for r in rows[1:])
    assert latest_iteration(tmp_path) == 3
    # Four writers, one manifest: every rank's shard is listed and verifies.
    ckpt = tmp_path / "iter_0000003"
    listed = json.loads((ckpt / MANIFEST).read_text())["files"]
    shards = sorted(p.name for p in ckpt.glob("*.distcp"))
    assert len(shards) == 4 and all(name in listed for name in shards)
    assert verify_checkpoint(ckpt) == []
