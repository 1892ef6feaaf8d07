"""Shared helpers of the training tests: the small model, one in-process run, multi-rank runs in
forked processes, checkpoint copies."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from _rank_processes import rank_context

from nemo_msa.training.checkpoint_integrity import POINTER
from nemo_msa.training.recipe import load_recipe
from nemo_msa.training.trainer import pretrain, teardown

#: The embedded default recipe shrunk (4 MSA layers of width 64, 256-token rows of Megatron mock
#: documents, 32-token blocks, top-2), so that a run of a few steps takes seconds on 2 cores.
SMALL = [
    "model.num_layers=4", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.kv_channels=16",
    "model.msa_index_head_dim=16", "model.seq_length=256", "model.vocab_size=256",
    "model.msa_block_size=32", "model.msa_topk=2", "train.global_batch_size=2",
    "train.micro_batch_size=1", "scheduler.lr_warmup_iters=1", "logger.progress_bar=false",
]

#: The reference run's schedule: 6 steps, 2 of dense warm-up.
REFERENCE = ["train.train_iters=6", "model.msa_dense_warmup_steps=2"]


def train(overrides: list[str]) -> dict:
    """One pretraining run in this process on the small model; returns its summary."""
    try:
        return pretrain(load_recipe(None, SMALL + overrides))
    finally:
        teardown()


def losses(history: list[dict], key: str = "loss") -> dict[int, float]:
    """``{iteration: value}`` of one metric of a run's history."""
    return {h["iteration"]: h[key] for h in history if key in h}


def copy_checkpoint(src_root: Path, iteration: int, dst_root: Path, pointer: bool = True) -> None:
    """Copy one finished checkpoint (and, by default, a pointer naming it) to ``dst_root``."""
    name = f"iter_{iteration:07d}"
    dst_root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src_root / name, dst_root / name)
    if pointer:
        (dst_root / POINTER).write_text(f"{iteration}\n")


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "pretrain.py"


def pretrain_script():
    """scripts/pretrain.py as a module, so that its ``main()`` runs in this process."""
    spec = importlib.util.spec_from_file_location("pretrain_cli", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cli(*args: str) -> int:
    """``python scripts/pretrain.py ARGS`` minus the interpreter start: the script's ``main()``
    in this process (its ``error:`` lines go to this process's stderr); returns the exit code.

    Each new interpreter pays the torch + Megatron import (seconds); one subprocess test per
    entry point (test_recipe.py's) proves the script's own wiring, the rest call ``main()``.
    """
    # main() quiets Megatron's loggers and torch's C++ log for a user's run; the tests after
    # this one (and the processes they start) keep theirs.
    levels = {name: logging.getLogger(name).level for name in ("megatron", "megatron.core")}
    cpp_log = os.environ.get("TORCH_CPP_LOG_LEVEL")
    try:
        return pretrain_script().main(list(args))
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        if cpp_log is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = cpp_log


def pretrain_cli(out: Path, *overrides: str, recipe: str | None = None,
                 timeout: int = 400) -> list[dict]:
    """One ``scripts/pretrain.py`` run in a subprocess (a GPU run: its own process group);
    returns the step rows of its metrics.jsonl."""
    cmd = [sys.executable, str(REPO / "scripts" / "pretrain.py")]
    if recipe is not None:
        cmd += ["--recipe", str(REPO / "recipes" / recipe)]
    cmd += [f"logger.output_dir={out}", "logger.progress_bar=false", "logger.plot=false",
            *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


@dataclass
class RanksResult:
    """What :func:`pretrain_ranks` gives back, as ``subprocess.run`` would for torchrun."""

    #: 0 when every rank returned 0, else the first non-zero exit code in rank order.
    returncode: int
    #: The ranks' standard output, rank 0's first.
    stdout: str
    #: The ranks' standard error, rank 0's first.
    stderr: str


def pretrain_ranks(nproc: int, args: list[str], timeout: float = 400) -> RanksResult:
    """``torchrun --standalone --nproc-per-node NPROC scripts/pretrain.py ARGS`` minus the
    interpreter starts: ``nproc`` processes forked from the fork server
    (tests/_rank_processes.py) each run the script's ``main()`` with torchrun's environment.

    torchrun's own part (its agent, its report of failed ranks) is what the torchrun tests
    (test_pretrain.py's resume refusal, test_restart.py's two-rank job) test; the rest take
    this. The ranks meet at a TCP store this process holds on a port the system picked, as
    torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``), so that no port is chosen before
    it is bound.

    Raises:
        TimeoutError: a rank still ran after ``timeout`` seconds (every rank is killed).
    """
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True,
                                       wait_for_workers=False)
    context = rank_context()
    with tempfile.TemporaryDirectory(prefix="pretrain-ranks-") as logs:
        ranks = [context.Process(target=_pretrain_rank,
                                 args=(rank, nproc, store.port, list(args), logs))
                 for rank in range(nproc)]
        for rank in ranks:
            rank.start()
        deadline = time.monotonic() + timeout
        try:
            for rank in ranks:
                rank.join(max(0.0, deadline - time.monotonic()))
            hung = [i for i, rank in enumerate(ranks) if rank.is_alive()]
            if hung:
                raise TimeoutError(f"ranks {hung} still ran after {timeout} s")
        finally:
            for rank in ranks:
                if rank.is_alive():
                    rank.kill()
                    rank.join(10)
        codes = [rank.exitcode for rank in ranks]
        out = "".join(Path(logs, f"{i}.out").read_text() for i in range(nproc))
        err = "".join(Path(logs, f"{i}.err").read_text() for i in range(nproc))
    return RanksResult(next((c for c in codes if c), 0), out, err)


def _pretrain_rank(rank: int, nproc: int, port: int, args: list[str], logs: str) -> None:
    """One rank of :func:`pretrain_ranks`, in its forked process."""
    # The process's own output files, open until it exits (C-level writes go there too).
    out = open(Path(logs, f"{rank}.out"), "w", buffering=1)
    err = open(Path(logs, f"{rank}.err"), "w", buffering=1)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout, sys.stderr = out, err
    os.chdir(REPO)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      OMP_NUM_THREADS="1")
    try:
        code = pretrain_script().main(args)
    except BaseException:  # as an uncaught exception in a torchrun rank: its traceback, code 1
        traceback.print_exc()
        code = 1
    out.flush()
    err.flush()
    sys.exit(code)
