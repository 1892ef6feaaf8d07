"""The pipeline integration recipe (recipes/msa_pp2_vpp2_tp2.yaml) collapsed to TP=1/PP=1 on one
GPU, bf16, the Triton backend (issue 6, what one GPU allows).

Writes pp1.log (the run's output and the checkpoint folder's listing) and pp1/ (the run's
metrics.jsonl and loss_curve.png; the checkpoint stays on the machine), and prints the log's
last 30 lines.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .. import options
from ..runner import python, write

NAME = "pp1"
HELP = "the pipeline recipe collapsed to TP=1/PP=1 on one GPU"

#: The recipe overrides that collapse it to one GPU.
OVERRIDES = ("model.tensor_model_parallel_size=1", "model.pipeline_model_parallel_size=1",
             "model.virtual_pipeline_model_parallel_size=null", "model.bf16=true",
             "optimizer.clip_grad=1.0", "model.msa_backend=triton", "logger.progress_bar=false")


def add_arguments(group) -> None:
    options.add_bound(group, 90.0)
    group.add_argument("--checkpoints", type=options.path, default="/tmp/pp1_checkpoints",
                       help="where the run saves (kept on the machine)")


def run(args, ctx) -> None:
    log = ctx.out / "pp1.log"
    ctx.note("", log, new=True)
    ctx.run(python("scripts/pretrain.py", "--recipe", "recipes/msa_pp2_vpp2_tp2.yaml",
                   *OVERRIDES, f"checkpoint.save={args.checkpoints}", log=log,
                   seconds=args.seconds))
    ctx.do(f"copy metrics.jsonl and loss_curve.png from {args.checkpoints} to {ctx.out / 'pp1'}",
           lambda: _keep(args.checkpoints, ctx.out / "pp1", log))
    if not ctx.dry:
        print("\n".join(log.read_text(errors="replace").splitlines()[-30:]))


def _keep(checkpoints: Path, dest: Path, log: Path) -> None:
    """The run's metrics and plot to ``dest``; the checkpoint folder's listing to ``log``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "loss_curve.png"):
        if (checkpoints / name).is_file():
            shutil.copy(checkpoints / name, dest / name)
    listing = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else []
    write(log, "".join(f"{name}\n" for name in listing))
