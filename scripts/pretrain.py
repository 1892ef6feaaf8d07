#!/usr/bin/env python
"""Pretrain a GPT model with MSA attention on Megatron-Core.

Examples::

    python scripts/pretrain.py                       # the embedded default, recipes/msa_tiny.yaml
    python scripts/pretrain.py train.train_iters=50 checkpoint.save=runs/tiny
    torchrun --nproc-per-node 2 scripts/pretrain.py --recipe recipes/msa_pp2_vpp2_tp2.yaml \\
        model.tensor_model_parallel_size=1

Overrides are Hydra-style ``section.key=value`` (sections: model, train, optimizer, scheduler,
dataset, checkpoint, logger, ddp, dist); values are parsed as YAML. A bad key or value stops the
run before anything is built, with one ``error:`` line naming it (exit code 2). A checkpoint that
cannot be resumed from, a checkpoint directory another run holds (its lock file), a save that
fails (disk full: the path and the cause) and a non-finite loss are one ``error:`` line too
(exit code 1), and so is running out of memory (naming the sizes that decide it). Resuming
with another schedule than the checkpoint's is one line naming the keys, both values and the
two scheduler flags that decide (exit code 2), and so is one that changes the model or the data
order (listed with every other changed key in one block; ``checkpoint.allow_recipe_change=true``
goes on). Under torchrun each such line is printed once per job, not once per rank. SIGTERM
ends the run like SIGINT (exit code 143), releasing the checkpoint lock; after a SIGKILL the
same command takes the dead run's lock over (one ``warning:`` line) and resumes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import warnings
from pathlib import Path

# Runs from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _quiet_third_party() -> None:
    # Megatron warns at import about optional fused kernels (TE, Apex) and GPTModel's
    # deprecation; on the CPU these are expected and drown the progress bar.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _one_line(err: Exception) -> str:
    """The error's message on one line (a wrapped library message may span several)."""
    return " ".join(part.strip() for part in str(err).splitlines() if part.strip())


def _exit_on_sigterm(signum, frame) -> None:
    # Unwinds like Ctrl-C, so the finally blocks run: the checkpoint lock is released and the
    # process group torn down (a save cut short leaves only a .partial directory, never read).
    raise SystemExit(128 + signum)


def _interrupted(recipe) -> str:
    """The line for a run stopped by Ctrl-C: the newest finished checkpoint, which the same
    command resumes from (a save cut short leaves only a .partial directory, never read)."""
    from nemo_msa.training.checkpoint_integrity import latest_iteration

    save = recipe.checkpoint.save if recipe is not None else None
    if not save:
        return "interrupted (Ctrl-C); nothing was saved (checkpoint.save is not set)"
    try:
        iteration = latest_iteration(save)
    except (OSError, RuntimeError, ValueError) as err:  # the next run's load says it in full
        return f"interrupted (Ctrl-C); the checkpoints in {save} could not be read: {err}"
    if not iteration:
        return f"interrupted (Ctrl-C) before the first checkpoint in {save}"
    return (f"interrupted (Ctrl-C); the same command resumes from the newest checkpoint in "
            f"{save} (iteration {iteration})")


def _is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError."""
    text = str(err)
    return isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError" or (
        isinstance(err, RuntimeError)
        and ("can't allocate memory" in text or "out of memory" in text.lower()))


def _memory_advice(recipe) -> str:
    """The recipe's sizes that decide memory, to name in the out-of-memory line."""
    if recipe is None:
        return ""
    model, gpt, train = recipe.model, recipe.gpt, recipe.train
    return (f" with model.hidden_size={model.get('hidden_size')}, "
            f"model.ffn_hidden_size={model.get('ffn_hidden_size')}, "
            f"model.num_layers={model.get('num_layers')}, model.seq_length={gpt.seq_length}, "
            f"train.micro_batch_size={train.micro_batch_size}; expected a model, sequence and "
            "micro batch that fit this machine's memory (make them smaller, or split the model "
            "with tensor/pipeline/context parallelism over more devices)")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, train, and return the process exit code."""
    parser = argparse.ArgumentParser(
        description="Pretrain an MSA GPT model with Megatron-Core (recipe + key=value overrides).")
    parser.add_argument("--recipe", default=None,
                        help="YAML recipe (default: the embedded recipes/msa_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    _quiet_third_party()

    # Imported only now: the package imports Megatron, whose import-time warnings the filters
    # above must already catch.
    from nemo_msa.training.checkpoint_integrity import CheckpointError
    from nemo_msa.training.recipe import RecipeError, load_recipe
    from nemo_msa.training.setup import first_to_report
    from nemo_msa.training.trainer import pretrain, teardown

    def report(text: str) -> None:
        # Once per job, not per rank: the ranks that meet the same error print it once.
        if first_to_report(text):
            print(f"error: {text}", file=sys.stderr, flush=True)

    recipe = None
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        pretrain(recipe)
    except RecipeError as err:
        report(_one_line(err))
        return 2
    except (CheckpointError, FloatingPointError) as err:
        report(_one_line(err))
        return 1
    except KeyboardInterrupt:
        # Ctrl-C is a user's stop, not a failure to trace: say what is kept and how to go on.
        report(_interrupted(recipe))
        return 128 + signal.SIGINT
    except (MemoryError, RuntimeError) as err:
        if not _is_out_of_memory(err):
            raise
        cause = _one_line(err)
        if len(cause) > 240:  # the allocator's text runs on into the failing module's repr
            cause = cause[:240].rsplit(" ", 1)[0] + " ..."
        report(f"out of memory ({cause}){_memory_advice(recipe)}")
        return 1
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    # Only as a script: a caller of main() keeps its own SIGTERM handling.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())
