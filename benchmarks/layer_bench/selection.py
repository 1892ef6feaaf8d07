"""The selections a benchmark row runs on: a trained-like regime for an untrained model, and what
the kernels' hybrid schedule makes of them (ADR 0031).

A freshly initialized indexer's index vectors are random, so every token's free blocks are close
to a uniform draw, the Triton kernels' worst case; a trained indexer's neighbouring queries pick
mostly the same blocks. :func:`coherent_index_hooks` gives the benchmark's MSA layers the second
regime without training: each index query becomes its 128-token compact block's first index
query plus 5% of its own (gradients reach both, so the indexer loss still trains the indexer),
as ``benchmarks/bench_msa.py --coherent`` draws its inputs. :func:`selection_stats` runs one untimed
step and reports the selections' tile unions.
"""

from __future__ import annotations

import torch
from msa_bench.unions import hybrid_work, tile_union_sizes

from nemo_msa.attention.triton_union import union_tile_tokens
from nemo_msa.triton.launch import current_launch
from nemo_msa.triton.tiles import next_pow2

#: The share of each token's own index query kept beside its block's shared one.
NOISE = 0.05


def _msa_layers(model) -> list:
    layers = getattr(model, "module", model).decoder.layers
    return [layer.self_attention for layer in layers
            if getattr(layer.self_attention, "indexer", None) is not None]


def coherent_index_hooks(model, block: int) -> list:
    """Makes every MSA layer's index queries coherent within ``block``-token compact blocks.

    Args:
        model: the benchmark's GPTModel (or its Float16Module).
        block: tokens that share one index query (the MSA block size).

    Returns:
        The hook handles (``handle.remove()`` undoes them).
    """
    def hook(_module, _inputs, output):
        index_q, index_k = output
        rows = torch.arange(index_q.shape[0], device=index_q.device)
        return index_q[rows // block * block] + NOISE * index_q, index_k

    return [attention.indexer.register_forward_hook(hook) for attention in _msa_layers(model)]


def selection_stats(model, bench) -> dict:
    """The first MSA layer's selection in one more (untimed) step: its 8-token tile unions at
    the forward's launch (``fwd.union_qt``, ``fwd.union_max``).

    Args:
        model: the benchmark's model; bench: the row's ``(prepare, run)``.

    Returns:
        ``{"union_qt", "union_mean", "union_kernel_share", "union_inflation"}`` (the mean union
        in blocks; the share of the exact (token, block) work the union kernel takes; its union
        work over that exact work), or ``{}`` where the model's layers select nothing (dense
        layers, the dense warm-up).
    """
    found: dict = {}

    def capture(_module, args, kwargs):
        # core_attention(query [T, Hq, d], key [T, Hkv, d], value, msa, q2k=..., ...)
        if "q2k" not in found and kwargs.get("q2k") is not None:
            found.update(q2k=kwargs["q2k"].detach(), msa=args[3],
                         group=args[0].shape[1] // args[1].shape[1])

    attentions = _msa_layers(model)
    if not attentions:
        return {}
    handle = attentions[0].core_attention.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        prepare, run = bench
        run(prepare())
    finally:
        handle.remove()
    if "q2k" not in found:
        return {}
    launch = current_launch("fwd")
    msa = found["msa"]
    # The tile the launch uses: union_qt, capped by the block and the rows one program holds.
    qt = union_tile_tokens(max(launch.union_qt, 1), msa.block_size,
                           max(16, next_pow2(found["group"])))
    union, tokens, exact = tile_union_sizes(found["q2k"].cpu(), msa.token_documents.cpu(),
                                            msa.document_positions.cpu(), qt)
    work = hybrid_work(union, tokens, exact, launch.union_max)
    return {"union_qt": qt, "union_mean": union.float().mean().item(),
            "union_kernel_share": work["union_exact_share"],
            "union_inflation": work["union_inflation"]}
