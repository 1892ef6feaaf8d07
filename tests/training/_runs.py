"""Shared helpers of the training tests: the small model, one in-process run, checkpoint copies."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

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
