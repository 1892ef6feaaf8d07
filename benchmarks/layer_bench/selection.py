"""The selections a benchmark row runs on: a trained-like regime for an untrained model, and what
the kernels' hybrid schedule makes of them (ADR 0031).

A freshly initialized indexer's index vectors are random, so every token's free blocks are close
to a uniform draw, the Triton kernels' worst case; a trained indexer's neighbouring queries pick
mostly the same blocks. :func:`coherent_index_hooks` gives the benchmark's MSA layers the second
regime without training: each index query becomes its 128-token compact block's first index
query plus 5% of its own (gradients reach both, so the indexer loss still trains the indexer),
as ``benchmarks/bench_msa.py --coherent`` draws its inputs. :func:`capture_core_attention` runs one
untimed step and keeps its first MSA layer's core-attention call; :func:`selection_stats` reports
that call's tile unions (and ``pairs.py`` times it against cuDNN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from msa_bench.unions import hybrid_work, tile_union_sizes

from nemo_msa.attention.triton_union import union_tile_tokens
from nemo_msa.q2k import Selection
from nemo_msa.query_view import QueryView
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


@dataclass
class CoreAttentionCall:
    """One call of an MSA layer's core attention as training made it.

    Attributes:
        module: the layer's ``MSACoreAttention`` (its ``softmax_scale`` included).
        args: ``(query [T, Hq, d], key [T, Hkv, d], value, view)``, q/k/v detached; ``view``
            the layout with the layer's queries (a ``QueryView``).
        kwargs: ``q2k`` (the layer's ``Selection``: canonical, so the timed op does not sort it
            again), ``plan``, ``return_block_mass``.
    """

    module: torch.nn.Module
    args: tuple
    kwargs: dict

    @property
    def view(self) -> QueryView:
        """The layout with the call's queries."""
        return QueryView.of(self.args[3])

    @property
    def msa(self):
        """The call's layout."""
        return self.view.msa

    @property
    def q2k(self) -> torch.Tensor:
        """The selection's int32 [Hkv, Tq, top_k] block ids."""
        q2k = self.kwargs["q2k"]
        return q2k.q2k if isinstance(q2k, Selection) else q2k


def capture_core_attention(model, bench) -> CoreAttentionCall | None:
    """The first MSA layer's first sparse core-attention call in one more (untimed) step.

    Args:
        model: the benchmark's model; bench: the row's ``(prepare, run)``.

    Returns:
        The call, or None where the model's layers select nothing (dense layers, the dense
        warm-up).
    """
    found: list[CoreAttentionCall] = []

    def capture(module, args, kwargs):
        # core_attention(query, key, value, view, q2k=selection, ...); a recompute's second
        # call in the backward repeats the first.
        if not found and kwargs.get("q2k") is not None:
            found.append(CoreAttentionCall(
                module, tuple(a.detach() if torch.is_tensor(a) else a for a in args),
                dict(kwargs)))

    attentions = _msa_layers(model)
    if not attentions:
        return None
    handle = attentions[0].core_attention.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        prepare, run = bench
        run(prepare())
    finally:
        handle.remove()
    return found[0] if found else None


def selection_stats(call: CoreAttentionCall | None) -> dict:
    """A captured call's selection: its 8-token tile unions at the forward's launch
    (``fwd.union_qt``, ``fwd.union_max``).

    Args:
        call: the first MSA layer's core-attention call (:func:`capture_core_attention`), or
            None.

    Returns:
        ``{"union_qt", "union_mean", "union_kernel_share", "union_inflation"}`` (the mean union
        in blocks; the share of the exact (token, block) work the union kernel takes; its union
        work over that exact work), or ``{}`` where ``call`` is None.
    """
    if call is None:
        return {}
    launch = current_launch("fwd")
    query, key = call.args[:2]
    msa = call.msa
    group = query.shape[1] // key.shape[1]
    # The tile the launch uses: union_qt, capped by the block and the rows one program holds.
    qt = union_tile_tokens(max(launch.union_qt, 1), msa.block_size, max(16, next_pow2(group)))
    union, tokens, exact = tile_union_sizes(call.q2k.cpu(), msa.token_documents.cpu(),
                                            msa.document_positions.cpu(), qt)
    work = hybrid_work(union, tokens, exact, launch.union_max)
    return {"union_qt": qt, "union_mean": union.float().mean().item(),
            "union_kernel_share": work["union_exact_share"],
            "union_inflation": work["union_inflation"]}
