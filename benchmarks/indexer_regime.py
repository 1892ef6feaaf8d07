#!/usr/bin/env python
"""The regime a trained indexer puts the kernels in: tile-union statistics of its selections.

The layer benchmarks time the Triton kernels on random selections (a fresh indexer's) or on the
``--coherent`` stand-in for a trained one (ADR 0031); issue #49 asks what a *trained* MSA model
actually selects at long rows. This script loads a checkpoint (``checkpoint.load``, e.g. an MSA
arm of ``scripts/quality_bench.py``), runs held-out rows of the validation split through it at
``model.seq_length`` (e.g. 32768 for a model trained at 8192) and reports per MSA layer and
union tile size ``qt``: the mean union of a tile's selected blocks, the share of tiles and of
the exact (token, block) work the union kernel would take at the cap ``--cap``, and its work
inflation (``benchmarks/msa_bench/unions.py``: the statistics the layer bench reports).
``qt = 1`` is the exact selection (inflation 1).

Beside the trained model's numbers, ``synthetic`` gives the same statistics for two made-up
selections on the same rows: ``random`` (each token's own block plus ``top_k - 1`` blocks drawn
uniformly from its document's earlier ones: an untrained indexer, the layer bench's fresh rows)
and ``block_shared`` (one such draw per block, shared by its tokens: the most coherent a
selection can be). Where a trained model's numbers fall between them says which benchmark rows
it resembles.

``--probe-rows N`` adds the passkey diagnosis (issue #49): N passkey rows per depth bucket
(``nemo_msa.training.probes``, the recipe's probe keys) run through the model, and for every
scored question token it reports how often the MSA layers select the block holding the needle
token that token must copy (``passkey_needle``: per depth bucket, the share over layers, KV heads
and tokens, the share of tokens for which at least one layer and head selects it, and the share a
uniform draw would give). A model that cannot answer although its layers select the needle
reads it and fails to use it; one whose layers do not select it never sees it.

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
import contextlib
import dataclasses
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "benchmarks"))

import torch  # noqa: E402
from msa_bench.unions import hybrid_work, tile_union_sizes  # noqa: E402

from nemo_msa.q2k import Selection  # noqa: E402
from nemo_msa.query_view import QueryView  # noqa: E402

#: Union tile sizes reported (tokens per tile) and the union kernels' default cap (blocks).
QTS = (1, 2, 4, 8)
CAP = 24


def msa_attentions(model) -> list:
    """The self-attention modules of ``model``'s MSA layers (those with an indexer)."""
    while hasattr(model, "module"):
        model = model.module
    return [layer.self_attention for layer in model.decoder.layers
            if getattr(layer.self_attention, "indexer", None) is not None]


@contextlib.contextmanager
def captured_selections(model):
    """Every MSA layer's selections in the forwards run inside, by layer number: a list of
    ``(q2k int [Hkv, T, top_k] on the CPU, the layout)`` per forward; the model runs in eval
    mode without gradients meanwhile.

    Yields:
        The dict, filled as the forwards run (a caller may clear it between them).
    """
    found: dict[int, list] = {}

    def hook_for(number: int):
        def capture(_module, args, kwargs):
            # core_attention(query [T, Hq, d], key [T, Hkv, d], value, view, q2k=selection, ...)
            selection = kwargs.get("q2k")
            if selection is not None:
                q2k = selection.q2k if isinstance(selection, Selection) else selection
                found.setdefault(number, []).append((q2k.detach().cpu(),
                                                     QueryView.of(args[3]).msa))
        return capture

    handles = [a.core_attention.register_forward_pre_hook(hook_for(a.layer_number),
                                                          with_kwargs=True)
               for a in msa_attentions(model)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield found
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


def tile_statistics(selections: list, qt: int, cap: int) -> dict:
    """The union statistics of ``qt``-token tiles over ``selections`` (``[(q2k, msa), ...]``):
    ``union_mean`` and :func:`hybrid_work`'s shares at the cap."""
    parts = [tile_union_sizes(q2k, msa.token_documents.cpu(), msa.document_positions.cpu(), qt)
             for q2k, msa in selections]
    union = torch.cat([p[0] for p in parts], dim=1)
    tokens = torch.cat([p[1] for p in parts])
    exact = torch.cat([p[2] for p in parts], dim=1)
    return {"union_mean": union.float().mean().item(), **hybrid_work(union, tokens, exact, cap)}


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
        "union_inflation"}}}, "mean": {qt: the same averaged over layers}, "synthetic":
        {"random" | "block_shared": {qt: the same}}}`` (:func:`synthetic_statistics` on the
        first MSA layer's layouts); empty when no layer selected (dense layers, the warm-up).
    """
    with captured_selections(model) as found:
        for mb in rows:
            model(mb.tokens, mb.position_ids, labels=None, **forward_kwargs(mb.packed_seq_ids))
    layers = {number: {qt: tile_statistics(captured, qt, cap) for qt in qts}
              for number, captured in sorted(found.items())}
    mean = {qt: {k: statistics.fmean(layers[n][qt][k] for n in layers)
                 for k in ("union_mean", "union_tiles", "union_exact_share", "union_inflation")}
            for qt in qts} if layers else {}
    synthetic = synthetic_statistics(found[min(found)], qts, cap) if found else {}
    return {"layers": layers, "mean": mean, "synthetic": synthetic}


def synthetic_selection(documents: torch.Tensor, positions: torch.Tensor, block: int,
                        top_k: int, heads: int, shared: bool,
                        generator: torch.Generator) -> torch.Tensor:
    """A made-up selection on a layout: each token's own block plus ``top_k - 1`` distinct blocks
    drawn uniformly from its document's earlier ones (fewer where fewer exist).

    Args:
        documents: int [T] document index of each compact token.
        positions: int [T] position of each token in its document.
        block: tokens per block.
        top_k: blocks per token.
        heads: KV heads (an independent draw each).
        shared: one draw per (document, block), shared by its tokens, instead of one per token.
        generator: the CPU generator of the draws.

    Returns:
        int64 [heads, T, top_k] document-local block ids, -1 for empty slots.
    """
    own = positions.long() // block
    width = int(own.max()) + 1 if own.numel() else 1
    q2k = torch.full((heads, own.numel(), top_k), -1, dtype=torch.long)
    q2k[:, :, 0] = own
    if top_k == 1:
        return q2k
    # Draw keys: per token, or per (document, block) so that a block's tokens agree.
    key = documents.long() * width + own if shared else torch.arange(own.numel())
    _, draw_of = torch.unique(key, return_inverse=True)
    draws = int(draw_of.max()) + 1
    earlier = torch.arange(width)[None, :] < own[:, None]
    for h in range(heads):
        scores = torch.rand(draws, width, generator=generator)[draw_of]
        top = scores.masked_fill(~earlier, -1.0).topk(min(top_k - 1, width), dim=1)
        q2k[h, :, 1:1 + top.indices.shape[1]] = torch.where(top.values >= 0, top.indices, -1)
    return q2k


def synthetic_statistics(captured: list, qts, cap: int, seed: int = 0) -> dict:
    """:func:`union_statistics`' numbers for :func:`synthetic_selection`'s random and
    block-shared selections on the captured layouts (``[(q2k, msa), ...]`` of one layer)."""
    generator = torch.Generator().manual_seed(seed)
    out: dict = {}
    for name, shared in (("random", False), ("block_shared", True)):
        fakes = [(synthetic_selection(msa.token_documents.cpu(), msa.document_positions.cpu(),
                                      msa.block_size, q2k.shape[-1], q2k.shape[0], shared,
                                      generator), msa)
                 for q2k, msa in captured]
        out[name] = {qt: tile_statistics(fakes, qt, cap) for qt in qts}
    return out


def passkey_needle_selection(model, probes, block: int, forward_kwargs,
                             device: torch.device) -> dict:
    """How often the MSA layers select the needle's block for the passkey question's tokens.

    Args:
        model: a GPTModel (or a wrapper with ``.module``) with MSA layers, in its sparse phase.
        probes: a passkey :class:`nemo_msa.training.probes.ProbeSet` (one document per row).
        block: the MSA block size.
        forward_kwargs: as in :func:`union_statistics`.
        device: where the model runs.

    Returns:
        ``{"buckets": {bucket: {"selected", "selected_any", "chance", "rows"}}, "layers":
        {layer_number: {bucket: selected}}}``: ``selected`` the share over (layer, KV head,
        scored token) of selections holding the block of the needle token the question token
        copies; ``selected_any`` the share of scored tokens that some layer and head selects
        it for; ``chance`` what a uniform draw of the free slots gives (its mean over tokens).
    """
    names = probes.names
    hits: dict[int, dict[str, list]] = {a.layer_number: {n: [] for n in names}
                                        for a in msa_attentions(model)}
    any_hits = {n: [] for n in names}
    chance = {n: [] for n in names}
    with captured_selections(model) as found:
        for row in range(probes.rows):
            kind, planted = probes.planted[row]
            if kind != "passkey":
                continue
            needle = planted[0][0]
            tokens = probes.tokens[row:row + 1].to(device)
            seq = tokens.shape[1]
            found.clear()
            model(tokens, torch.arange(seq, device=device)[None], labels=None,
                  **forward_kwargs(torch.ones_like(tokens)))
            group = probes.group[row]
            scored = torch.nonzero(group >= 0).flatten()
            question = int(scored[0])
            # Token question + j predicts key j; it must read key j at needle + 1 + j.
            wanted = (needle + 1 + (scored - question)) // block
            top_k = next(iter(found.values()))[0][0].shape[-1]
            own = scored // block
            free = torch.clamp(own, min=1).double()
            draw = torch.where(own > 0, torch.clamp((top_k - 1) / free, max=1.0), 0.0)
            bucket = names[int(group[scored[0]])]
            anyone = torch.zeros(scored.numel(), dtype=torch.bool)
            for number, captured in found.items():
                q2k = captured[-1][0]
                # q2k [Hkv, T, top_k]: one document per row, so compact token = position.
                sel = (q2k[:, scored, :] == wanted[None, :, None]).any(-1)
                hits[number][bucket].append(sel.double().mean().item())
                anyone |= sel.any(0)
            any_hits[bucket].append(anyone.double().mean().item())
            chance[bucket].append(draw.mean().item())
    used = [n for n in names if any_hits[n]]
    return {
        "buckets": {n: {"selected": statistics.fmean(statistics.fmean(hits[k][n])
                                                     for k in hits if hits[k][n]),
                        "selected_any": statistics.fmean(any_hits[n]),
                        "chance": statistics.fmean(chance[n]),
                        "rows": len(any_hits[n])} for n in used},
        "layers": {k: {n: statistics.fmean(hits[k][n]) for n in used if hits[k][n]}
                   for k in hits},
    }


def main(argv: list[str] | None = None) -> dict:
    """Load the checkpoint, run ``--rows`` validation rows, print and return the statistics."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=None, help="the arm's recipe (default: embedded)")
    parser.add_argument("--rows", type=int, default=2, help="validation rows (default 2)")
    parser.add_argument("--qts", default=",".join(map(str, QTS)), help="union tile sizes")
    parser.add_argument("--cap", type=int, default=CAP, help=f"union cap (default {CAP})")
    parser.add_argument("--probe-rows", type=int, default=0,
                        help="passkey rows per depth bucket for the needle diagnosis (0: none)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (checkpoint.load=...)")
    args = parser.parse_args(argv)
    from nemo_msa.training.build import build_training
    from nemo_msa.training.checkpoint import load_checkpoint
    from nemo_msa.training.data import MicrobatchSource, build_gpt_datasets, eod_token_id
    from nemo_msa.training.probes import ProbeSettings, build_probes
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
    if args.rows <= 0 or args.cap <= 0 or args.probe_rows < 0:
        raise SystemExit(f"error: --rows = {args.rows}, --cap = {args.cap}, --probe-rows = "
                         f"{args.probe_rows}: expected > 0, > 0 and >= 0")
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
        if args.probe_rows:
            settings = dataclasses.replace(
                ProbeSettings.from_train(recipe.train, recipe.gpt.seq_length),
                kinds=("passkey",), rows=args.probe_rows)
            probes = build_probes(valid, settings, recipe.gpt.seq_length,
                                  eod_token_id(recipe.dataset, recipe.gpt))
            stats["passkey_needle"] = passkey_needle_selection(
                objs.chunks[0], probes, objs.config.msa_block_size,
                objs.hooks.model_forward_kwargs, ctx.device)
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
