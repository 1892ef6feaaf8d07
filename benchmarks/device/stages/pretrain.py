"""A few hundred steps of single-GPU pretraining (scripts/pretrain.py), bf16, the Triton
backend, 2048 tokens, blocks of 64, top-8, a 50-step dense warm-up (issue 5, item 9).

Writes pretrain.log (the run's output) and the run's metrics under pretrain/, and prints the
log's last 60 lines.
"""

from __future__ import annotations

from .. import options
from ..runner import python

NAME = "pretrain"
HELP = "single-GPU bf16 pretraining with the Triton backend, a few hundred steps"

#: The recipe overrides of the run (the default recipe otherwise).
OVERRIDES = ("model.bf16=true", "optimizer.clip_grad=1.0", "model.msa_backend=triton",
             "model.seq_length=2048", "model.msa_block_size=64", "model.msa_topk=8",
             "model.kv_channels=64", "model.msa_index_head_dim=64",
             "model.msa_dense_warmup_steps=50", "train.global_batch_size=8",
             "train.micro_batch_size=4", "logger.progress_bar=false", "logger.log_interval=25")


def add_arguments(group) -> None:
    group.add_argument("--steps", type=options.count, default=300, help="training iterations")
    options.add_bound(group, 240.0)
    group.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="more recipe overrides, e.g. model.msa_indexer_loss_type=sparse")


def run(args, ctx) -> None:
    log = ctx.out / "pretrain.log"
    ctx.note("", log, new=True)
    ctx.run(python("scripts/pretrain.py", *OVERRIDES, f"train.train_iters={args.steps}",
                   f"logger.output_dir={ctx.out / 'pretrain'}", *args.overrides, log=log,
                   seconds=args.seconds))
    if not ctx.dry:
        print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
