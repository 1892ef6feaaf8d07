#!/usr/bin/env python
"""The regime a trained indexer puts the kernels in: tile-union statistics of its selections.

The layer benchmarks time the Triton kernels on random selections (a fresh indexer's) or on the
``--coherent`` stand-in for a trained one (ADR 0031); issue #49 asks what a *trained* MSA model
actually selects at long rows. This script loads a checkpoint (``checkpoint.load``, e.g. an MSA
arm of ``scripts/quality_bench.py``), runs held-out rows of the validation split through it at
``model.seq_length`` (e.g. 32768 for a model trained at 8192) and reports per MSA layer and
union tile size ``qt``: the mean union of a tile's selected blocks, the share of tiles and of
the exact (token, block) work the union kernel would take at the cap ``--cap``, and its work
inflation (``benchmarks/msa_bench/unions.py``: the statistics ``benchmarks/union_stats.py`` and the
layer bench report). ``qt = 1`` is the exact selection (inflation 1).

One process, no tensor/pipeline/context parallelism (the statistics need each layer's whole
selection). Example::

    python benchmarks/indexer_regime.py --recipe recipes/quality_bench.yaml --rows 2 \\
        --out runs/quality49/regime_8192_at_32768.json \\
        dataset.data_path=[/tmp/corpus/pycode_text_document] model.seq_length=32768 \\
        checkpoint.load=runs/quality49/seq8192/msa train.global_batch_size=1 \\
        train.micro_batch_size=1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "benchmarks"))

import torch  # noqa: E402
from msa_bench.unions import hybrid_work, tile_union_sizes  # noqa: E402

#: Union tile sizes reported (tokens per tile) and the union kernels' default cap (blocks).
QTS = (1, 2, 4, 8)
CAP = 24


def msa_attentions(model) -> list:
    """The self-attention modules of ``model``'s MSA layers (those with an indexer)."""
    while hasattr(model, "module"):
        model = model.module
    return [layer.self_attention for layer in model.decoder.layers
            if getattr(layer.self_attention, "indexer", None) is not None]


def union_statistics(model, rows: list, forward_kwargs, qts=QTS, cap: int = CAP) -> dict:
    """Tile-union statistics of every MSA layer's selections on ``rows``.

    Args:
        model: a GPTModel (or a wrapper with ``.module``) with MSA layers, in its sparse phase.
        rows: Microbatches (``tokens``, ``position_ids``, ``packed_seq_ids`` [b, S]).
        forward_kwargs: ``packed_seq_ids -> dict`` of GPTModel.forward keywords (the training
            hooks' ``model_forward_kwargs``).
        qts: union tile sizes in tokens.
        cap: the union kernels' cap in blocks (``union_max``): tiles with a larger union go to
            the per-token kernels.

    Returns:
        ``{"layers": {layer_number: {qt: {"union_mean", "union_tiles", "union_exact_share",
        "union_inflation"}}}, "mean": {qt: the same averaged over layers}}``; empty ``layers``
        when no layer selected (dense layers, the dense warm-up).
    """
    found: dict[int, list] = {}
    handles = []
    for attention in msa_attentions(model):
        def capture(_module, args, kwargs, number=attention.layer_number):
            # core_attention(query [T, Hq, d], key [T, Hkv, d], value, msa, q2k=..., ...)
            if kwargs.get("q2k") is not None:
                found.setdefault(number, []).append((kwargs["q2k"].detach().cpu(), args[3]))
        handles.append(attention.core_attention.register_forward_pre_hook(capture,
                                                                         with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for mb in rows:
                model(mb.tokens, mb.position_ids, labels=None,
                      **forward_kwargs(mb.packed_seq_ids))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    layers: dict[int, dict[int, dict]] = {}
    for number, captured in sorted(found.items()):
        layers[number] = {}
        for qt in qts:
            parts = []
            for q2k, msa in captured:
                union, tokens, exact = tile_union_sizes(
                    q2k, msa.token_documents.cpu(), msa.document_positions.cpu(), qt)
                parts.append((union, tokens, exact))
            union = torch.cat([p[0] for p in parts], dim=1)
            tokens = torch.cat([p[1] for p in parts])
            exact = torch.cat([p[2] for p in parts], dim=1)
            layers[number][qt] = {"union_mean": union.float().mean().item(),
                                  **hybrid_work(union, tokens, exact, cap)}
    mean = {qt: {k: statistics.fmean(layers[n][qt][k] for n in layers)
                 for k in ("union_mean", "union_tiles", "union_exact_share", "union_inflation")}
            for qt in qts} if layers else {}
    return {"layers": layers, "mean": mean}


def main(argv: list[str] | None = None) -> dict:
    """Load the checkpoint, run ``--rows`` validation rows, print and return the statistics."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=None, help="the arm's recipe (default: embedded)")
    parser.add_argument("--rows", type=int, default=2, help="validation rows (default 2)")
    parser.add_argument("--qts", default=",".join(map(str, QTS)), help="union tile sizes")
    parser.add_argument("--cap", type=int, default=CAP, help=f"union cap (default {CAP})")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (checkpoint.load=...)")
    args = parser.parse_args(argv)
    from nemo_msa.training.build import build_training
    from nemo_msa.training.checkpoint import load_checkpoint
    from nemo_msa.training.data import MicrobatchSource, build_gpt_datasets, eod_token_id
    from nemo_msa.training.recipe import load_recipe
    from nemo_msa.training.setup import (
        init_distributed,
        init_model_parallel,
        set_seeds,
        teardown,
    )

    # Nothing trains here: the checkpoint's schedule stands, whatever the recipe's.
    recipe = load_recipe(args.recipe, [*args.overrides,
                                       "scheduler.override_opt_param_scheduler=false",
                                       "scheduler.use_checkpoint_opt_param_scheduler=true"])
    if not recipe.checkpoint.load:
        raise SystemExit("error: recipe key 'checkpoint.load' = None: expected the checkpoint "
                         "directory of a trained MSA model")
    if args.rows <= 0 or args.cap <= 0:
        raise SystemExit(f"error: --rows = {args.rows}, --cap = {args.cap}: expected > 0")
    qts = [int(x) for x in args.qts.split(",") if x.strip()]
    ctx = init_distributed(recipe)
    try:
        init_model_parallel(recipe, ctx)
        set_seeds(recipe.train.seed)
        objs = build_training(recipe, ctx)
        if len(objs.chunks) != 1:
            raise SystemExit("error: one model chunk expected (no pipeline parallelism)")
        state = load_checkpoint(recipe.checkpoint.load, objs.chunks, objs.optimizer,
                                objs.scheduler, recipe=recipe.resolved)
        phase = objs.hooks.set_training_phase(state.iteration)
        _, valid = build_gpt_datasets(recipe.dataset, recipe.gpt, recipe.train.seed,
                                      recipe.train.global_batch_size, args.rows)
        if valid is None:
            raise SystemExit(f"error: recipe key 'dataset.split' = {recipe.dataset.split!r}: "
                             "no validation split to read rows from")
        source = MicrobatchSource(valid, micro_batch_size=1, global_batch_size=args.rows,
                                  dp_size=1, dp_rank=0,
                                  eod_id=eod_token_id(recipe.dataset, recipe.gpt),
                                  device=ctx.device,
                                  reset_position_ids=recipe.dataset.reset_position_ids)
        stats = union_statistics(objs.chunks[0], source.step_microbatches(),
                                 objs.hooks.model_forward_kwargs, qts, args.cap)
    finally:
        teardown()
    report = {"checkpoint": str(recipe.checkpoint.load), "iteration": state.iteration,
              "phase": phase, "seq_length": recipe.gpt.seq_length, "rows": args.rows,
              "cap": args.cap, **stats}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text, flush=True)
    return report


if __name__ == "__main__":
    main()
