"""Restart by repeating the command, and deterministic runs, on the CPU (ADRs 0049 and 0050).

A run of ``scripts/pretrain.py`` is SIGKILLed (an OOM kill, a preemption): during a save (no
manifest yet), in the middle of a metrics line, and, on two gloo ranks (PP=2, 1F1B), between
a checkpoint's rename and its pointer. The same command then takes the dead run's lock over with
one line and resumes from the newest verified checkpoint. Every run here has
``model.deterministic_mode=true`` and is compared with the uninterrupted reference run
(tests/training/conftest.py: one process, the mode off, which on the CPU changes no bit): the
losses of every step of the killed run and of the resumed one, and the content digests
(:mod:`nemo_msa.training.checkpoint_digests`) of the killed run's own checkpoint and of the
resumed run's last one, bit for bit. So two runs of one seed agree, and so does an interrupted
and resumed one. The pipeline run computes one process's losses and tensors bit for bit too;
its own uninterrupted last checkpoint (complete when the job was killed) is the one its resume
must reproduce in every item.

No process of a killed job may outlive it (issue #48: Megatron's writer used to leave a
multiprocessing Manager and the resource tracker behind).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from _interrupt import (
    REPO,
    SCRIPT,
    command,
    driver,
    finish,
    group_members,
    kill_tree,
    start,
    survivors,
    wait_for,
)
from _runs import REFERENCE, SMALL, copy_checkpoint, losses, train

from nemo_msa.training.checkpoint_digests import content_digests
from nemo_msa.training.checkpoint_integrity import (
    finished_iterations,
    latest_iteration,
    verify_checkpoint,
)
from nemo_msa.training.checkpoint_lock import LOCK_NAME

#: The command of every run here, less ``checkpoint.save``.
ARGS = [*SMALL, *REFERENCE, "checkpoint.save_interval=3", "model.deterministic_mode=true",
        "logger.plot=false"]


@pytest.fixture(scope="session")
def reference_digests(reference):
    """Content digests of the reference's checkpoints: ``{3: ..., 6: ...}``."""
    root, _ = reference
    return {it: content_digests(root / f"iter_{it:07d}") for it in (3, 6)}


def _metrics(root: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    iterations = [r["iteration"] for r in rows]
    assert iterations == sorted(set(iterations)), iterations  # one line per step, in order
    return {r["iteration"]: r["loss"] for r in rows}


def _takeover_lines(text: str, root: Path, pid: int) -> list[str]:
    pattern = (rf"warning: checkpoint directory {re.escape(str(root))}: took over the lock of a "
               rf"run that is gone \(host {re.escape(socket.gethostname())}, pid {pid}, started "
               rf"[\d\-T:+]+\): pid {pid} is no longer running on this host; the run resumes "
               r"from the newest verified checkpoint there, if any")
    lines = [line for line in text.splitlines() if "took over" in line]
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), lines
    return lines


#: One process: where the child is killed (module, function, condition on its arguments, what
#: the driver does there).
KILL_POINTS = {
    # dist-checkpointing has written iter_6.partial; no manifest, no rename.
    "during the save": ("nemo_msa.training.checkpoint", "write_manifest", "args[1] == 6",
                        "kill"),
    # Half of step 5's metrics line is written (iter_3 is the newest checkpoint).
    "mid metrics line": ("nemo_msa.training.ux", "MetricsLog.write",
                         "args[1]['iteration'] == 5", "cut"),
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_then_the_same_command_resumes_bit_for_bit(reference, reference_digests,
                                                           tmp_path, capfd, point):
    _, ref = reference
    want = losses(ref["history"])
    root = tmp_path / "ckpt"
    args = [*ARGS, f"checkpoint.save={root}"]
    path, _ = driver(tmp_path, *KILL_POINTS[point])
    child = start(command(path, args), tmp_path / "child.log")
    returncode = finish(child)
    assert returncode == -signal.SIGKILL, (tmp_path / "child.log").read_text()[-3000:]
    assert survivors(group_members(child.pid)) == []
    assert latest_iteration(root) == 3 and (root / LOCK_NAME).is_file()
    # Two runs of one seed: the killed run's steps and checkpoint are the reference's.
    if point == "during the save":
        assert (root / "iter_0000006.partial").is_dir() and finished_iterations(root) == [3]
        assert _metrics(root) == want
    else:
        text = (root / "metrics.jsonl").read_text()
        assert not text.endswith("\n")  # the cut line
        whole = [json.loads(x) for x in text.splitlines()[:-1]]
        assert {r["iteration"]: r["loss"] for r in whole} == {i: want[i] for i in (1, 2, 3, 4)}
    assert content_digests(root / "iter_0000003") == reference_digests[3]

    capfd.readouterr()
    resumed = train(args[len(SMALL):])  # the same command
    err = capfd.readouterr().err
    _takeover_lines(err, root, child.pid)
    cut = [line for line in err.splitlines() if "cut short" in line]
    if point == "mid metrics line":
        assert len(cut) == 1 and re.fullmatch(
            rf"warning: {re.escape(str(root / 'metrics.jsonl'))}: line 5 \(\d+ bytes\) cut "
            r"short, not a whole record \(the run that wrote it was killed while writing\): "
            r"dropped; the log continues after iteration 3", cut[0]), cut
    else:
        assert cut == []
    assert "(resumed at 3)" in resumed["steps"]
    assert losses(resumed["history"]) == want  # every step, bit for bit
    assert _metrics(root) == want
    assert latest_iteration(root) == 6 and verify_checkpoint(root / "iter_0000006") == []
    assert content_digests(root / "iter_0000006") == reference_digests[6]
    assert not (root / "iter_0000006.partial").exists() and not (root / LOCK_NAME).exists()


@pytest.mark.slow
def test_two_pipeline_ranks_killed_before_the_pointer_resume_bit_for_bit(reference, tmp_path):
    """torchrun, PP=2 on two gloo ranks (1F1B; PP=2 x VPP=2 runs in test_context_parallel_runs.py
    and test_pretrain.py), continuing the reference from its iteration 3;
    the whole job (agent and workers) is SIGKILLed once iter_6 is renamed but the pointer still
    names 3, so iter_6 is the uninterrupted run's last checkpoint. The same torchrun command
    takes over and resumes from 3: the same losses as one process, and an iter_6 equal to the
    killed run's in every item (the RNG states and layout of two stages included)."""
    ref_root, ref = reference
    want = losses(ref["history"])
    root = tmp_path / "ckpt"
    copy_checkpoint(ref_root, 3, root)
    args = [*ARGS, f"checkpoint.save={root}", "model.pipeline_model_parallel_size=2"]
    path, marker = driver(tmp_path, "nemo_msa.training.checkpoint", "_write_pointer",
                          "args[1] == 6", "hold")
    log = tmp_path / "job.log"
    job = start(command(path, args, nproc=2), log)
    wait_for(marker, job, log)
    record = json.loads((root / LOCK_NAME).read_text())
    killed = kill_tree(job.pid)
    assert finish(job) == -signal.SIGKILL
    assert survivors(killed) == []
    assert record["pid"] in killed  # rank 0 held the lock
    assert finished_iterations(root) == [3, 6] and latest_iteration(root) == 3
    uninterrupted = content_digests(root / "iter_0000006")
    tail = {it: want[it] for it in (4, 5, 6)}  # the copied checkpoint brought no metrics log
    assert _metrics(root) == tail  # two stages compute one process's losses bit for bit

    proc = subprocess.run(command(SCRIPT, args, nproc=2), capture_output=True, text=True,
                          timeout=400, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    _takeover_lines(proc.stderr, root, record["pid"])
    assert "layout TPxPPxVPPxDP : 1x2x1x1" in proc.stdout
    rows = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert {r["iteration"]: r["loss"] for r in rows} == tail
    for r in rows:
        want_idx = losses(ref["history"], "indexer_loss")[r["iteration"]]
        assert r["indexer_loss"] == pytest.approx(want_idx, rel=1e-4), r
    # Rank 0's two MSA layers used one layout per microbatch.
    assert all(r["layouts_per_microbatch"] == 1.0 for r in rows)
    assert latest_iteration(root) == 6 and verify_checkpoint(root / "iter_0000006") == []
    resumed = content_digests(root / "iter_0000006")
    assert resumed == uninterrupted
    # The model and optimizer tensors are one process's too (the RNG states are per stage).
    reference_6 = content_digests(ref_root / "iter_0000006")
    tensors = [k for k in reference_6 if "/" not in k]
    assert tensors and all(resumed[k] == reference_6[k] for k in tensors)
    assert not (root / LOCK_NAME).exists()
