"""The selections a benchmark row runs on: trained-like regimes for an untrained model, and what
the kernels' hybrid schedule makes of them (ADR 0031).

A freshly initialized indexer's index vectors are random, so every token's free blocks are close
to a uniform draw, the Triton kernels' worst case; a trained indexer's neighbouring queries pick
mostly the same blocks. :func:`coherent_index_hooks` gives the benchmark's MSA layers that regime
without training: each index query becomes its 128-token compact block's first index query plus
a share (``noise``) of its own (gradients reach both, so the indexer loss still trains the
indexer), as ``benchmarks/bench_msa.py --coherent`` draws its inputs. At 5% (``coherent``) the
tokens of a block select nearly the same blocks; :func:`calibrate_trained_noise` finds the share
at which the 8-token tiles' unions are the size a trained indexer's are (``trained``,
:data:`TRAINED_UNION_PER_TOPK`). :func:`capture_core_attention` runs one untimed step and keeps its
first MSA layer's core-attention call; :func:`selection_stats` reports that call's tile unions
(and ``pairs.py`` times it against cuDNN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from msa_bench.unions import hybrid_work, tile_union_sizes

from nemo_msa.attention.triton_union import union_tile_tokens
from nemo_msa.ops import select_blocks
from nemo_msa.q2k import Selection
from nemo_msa.query_view import QueryView
from nemo_msa.triton.launch import current_launch
from nemo_msa.triton.tiles import next_pow2

#: The share of each token's own index query kept beside its block's shared one (``coherent``).
NOISE = 0.05

#: A trained indexer's mean 8-token-tile union over its top-k (``benchmarks/indexer_regime.py`` on
#: the quality benchmark's MSA arms, top-8 of 64-token blocks, docs/performance.md "Which regime
#: a trained indexer is in"): 13.3 / 8 blocks on 8192-token rows (trained at 8192), 19.4 / 8 on
#: 32768-token rows (trained at 32768, the longest measured). Scaled to another top-k as this
#: ratio; rows whose mean document is longer than 8192 tokens take the 32768 figure.
TRAINED_UNION_PER_TOPK = {8192: 13.3 / 8, 32768: 19.4 / 8}

#: Tokens per tile of the trained regime's union statistic (the measurement's tile).
TRAINED_TILE = 8


def _msa_layers(model) -> list:
    layers = getattr(model, "module", model).decoder.layers
    return [layer.self_attention for layer in layers
            if getattr(layer.self_attention, "indexer", None) is not None]


def coherent_index(index_q: torch.Tensor, block: int, noise: float) -> torch.Tensor:
    """Index queries made coherent within ``block``-token compact blocks.

    Args:
        index_q: [T, H, d] the indexer's index queries (any float dtype).
        block: tokens that share one index query (the MSA block size).
        noise: the share of each token's own index query kept beside its block's first one.

    Returns:
        [T, H, d], ``index_q``'s dtype: each row is its block's first row plus ``noise`` times
        its own.
    """
    rows = torch.arange(index_q.shape[0], device=index_q.device)
    return index_q[rows // block * block] + noise * index_q


def coherent_index_hooks(model, block: int, noise: float | dict = NOISE) -> list:
    """Makes every MSA layer's index queries coherent within ``block``-token compact blocks.

    Args:
        model: the benchmark's GPTModel (or its Float16Module).
        block: tokens that share one index query (the MSA block size).
        noise: the share of a token's own index query kept (:func:`coherent_index`), or a dict
            whose ``"noise"`` entry the hooks read at every call (a row may set it before its
            steps: the ``trained`` regime's calibrated share).

    Returns:
        The hook handles (``handle.remove()`` undoes them).
    """
    def hook(_module, _inputs, output):
        index_q, index_k = output
        share = noise["noise"] if isinstance(noise, dict) else noise
        return coherent_index(index_q, block, share), index_k

    return [attention.indexer.register_forward_hook(hook) for attention in _msa_layers(model)]


def trained_union_target(top_k: int, doc_tokens: int) -> tuple[float, str]:
    """The mean 8-token-tile union (in blocks) the ``trained`` regime aims at.

    Args:
        top_k: blocks per query of the benchmark's layers.
        doc_tokens: the row's (mean) document length in tokens.

    Returns:
        ``(union, source)``: :data:`TRAINED_UNION_PER_TOPK`'s ratio for that length times
        ``top_k``, and which measurement it came from.
    """
    length = 8192 if doc_tokens <= 8192 else 32768
    ratio = TRAINED_UNION_PER_TOPK[length]
    return ratio * top_k, (f"indexer_regime.py, quality model trained and evaluated at {length} "
                           f"tokens: 8-token-tile union {ratio:.3f} x top-k")


def mean_tile_union(q2k: torch.Tensor, msa, qt: int = TRAINED_TILE) -> float:
    """The mean union of ``q2k``'s ``qt``-token tiles, in blocks (:func:`tile_union_sizes`).

    Args:
        q2k: int32 [Hkv, T, top_k] a selection of every token of ``msa``.
        msa: its layout.
        qt: tokens per tile.
    """
    union, _, _ = tile_union_sizes(q2k.cpu(), msa.token_documents.cpu(),
                                   msa.document_positions.cpu(), qt)
    return union.float().mean().item()


def calibrate_trained_noise(select, index_q: torch.Tensor, block: int, target: float,
                            qt: int = TRAINED_TILE, rounds: int = 14) -> dict:
    """The share of a token's own index query at which the selections' mean ``qt``-token-tile
    union is ``target`` blocks: a bisection on the share's logarithm.

    The union grows with the share (0: a block's tokens select alike; large: each token on its
    own, an untrained indexer's spread), so a bisection over 1e-4..1e4 finds it; a target
    outside what the two ends give returns the nearer end.

    Args:
        select: ``index_q -> (q2k, msa)``, the layer's selection of a candidate's index
            queries (int32 [Hkv, T, top_k] and its layout).
        index_q: [T, H, d] the indexer's own index queries of one step.
        block: the MSA block size (the coherent hook's block).
        target: the mean tile union to reach, in blocks.
        qt: tokens per tile.
        rounds: bisection steps.

    Returns:
        ``{"noise", "union", "target"}``: the share found and the union it gives.
    """
    def union_at(noise: float) -> float:
        q2k, msa = select(coherent_index(index_q, block, noise))
        return mean_tile_union(q2k, msa, qt)

    low, high = math.log(1e-4), math.log(1e4)
    ends = {low: union_at(math.exp(low)), high: union_at(math.exp(high))}
    if target <= ends[low] or target >= ends[high]:
        edge = low if target <= ends[low] else high
        return {"noise": math.exp(edge), "union": ends[edge], "target": target}
    best = (math.inf, None, None)
    for _ in range(rounds):
        middle = (low + high) / 2
        union = union_at(math.exp(middle))
        if abs(union - target) < best[0]:
            best = (abs(union - target), math.exp(middle), union)
        low, high = (middle, high) if union < target else (low, middle)
    return {"noise": best[1], "union": best[2], "target": target}


def capture_index_inputs(model, bench) -> tuple | None:
    """The first MSA layer's indexer outputs and layout in one more (untimed) step, as the
    indexer made them (before any coherent hook).

    Args:
        model: the benchmark's model; bench: the row's ``(prepare, run)``.

    Returns:
        ``(index_q [T, H, d], index_k [T, d], msa)``, detached, or None where no MSA layer
        selected.
    """
    found: dict = {}
    attentions = _msa_layers(model)
    if not attentions:
        return None

    def keep(_module, _inputs, output):
        found.setdefault("index", tuple(x.detach() for x in output))

    def keep_layout(_module, args, kwargs):
        # core_attention(query, key, value, view, q2k=selection, ...)
        if kwargs.get("q2k") is not None:
            found.setdefault("msa", QueryView.of(args[3]).msa)

    # Prepended, so it runs before the coherent hooks and sees the indexer's own output.
    handles = [attentions[0].indexer.register_forward_hook(keep, prepend=True),
               attentions[0].core_attention.register_forward_pre_hook(keep_layout,
                                                                       with_kwargs=True)]
    try:
        prepare, run = bench
        run(prepare())
    finally:
        for handle in handles:
            handle.remove()
    if "index" not in found or "msa" not in found:
        return None
    return (*found["index"], found["msa"])


def calibrate_row(model, bench, holder: dict, doc_tokens: int) -> dict:
    """Sets ``holder["noise"]`` (the coherent hooks' share) so that the first MSA layer's
    selections have a trained indexer's tile unions (:func:`trained_union_target`).

    Args:
        model: the benchmark's model with :func:`coherent_index_hooks` reading ``holder``.
        bench: the row's ``(prepare, run)``; one more untimed step runs.
        holder: the hooks' ``{"noise": share}``.
        doc_tokens: the row's (mean) document length.

    Returns:
        The row's ``trained_*`` fields (``trained_noise``, ``trained_union``,
        ``trained_union_target``, ``trained_source``), or ``{}`` where nothing selected.
    """
    captured = capture_index_inputs(model, bench)
    if captured is None:
        return {}
    index_q, index_k, msa = captured
    attention = _msa_layers(model)[0]
    plan = attention.msa_plan
    target, source = trained_union_target(plan.topology.top_k, doc_tokens)

    def select(candidate: torch.Tensor):
        q2k = select_blocks(candidate, index_k, msa, top_k=plan.topology.top_k,
                            score=plan.topology.score_type, backend=plan.backend)
        return q2k, msa

    found = calibrate_trained_noise(select, index_q, msa.block_size, target)
    holder["noise"] = found["noise"]
    return {"trained_noise": found["noise"], "trained_union": found["union"],
            "trained_union_target": target, "trained_source": source}


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
