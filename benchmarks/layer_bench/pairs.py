"""Attention work in (query, key) pairs, and each MSA row's pair rate against cuDNN (issue #50).

A query at document position ``p`` sees ``p + 1`` keys, so dense attention within a document of
``n`` tokens computes ``n (n + 1) / 2`` pairs. MSA attends the visible keys of the blocks its
selection keeps: a selected block ``b`` contributes ``min(block, p - b * block + 1)`` keys (its
own block ``p % block + 1``, an earlier one all ``block``). :func:`selected_pairs` counts them
exactly from a q2k; :func:`document_pairs` bounds them analytically (ADR 0031's floor).

Each pair costs ``14 * heads * head_dim`` FLOPs forward + backward: two matmuls forward (S and
P V), five backward (S again, dP, dV, dQ, dK), two FLOPs per multiply-add.

:func:`pair_rate` times the first MSA layer's captured core-attention call (forward + backward,
as training calls it) and cuDNN's dense attention on the same q/k/v and documents, and divides
each side's pairs by its time: the sparse kernels' rate of useful work against cuDNN's.
"""

from __future__ import annotations

import argparse
import math

import torch
from layer_bench.selection import CoreAttentionCall
from layer_bench.steps import cudnn_document_attention
from layer_bench.timing import run_timed

from nemo_msa.q2k import Selection, canonical_q2k
from nemo_msa.query_view import QueryView

#: Matmul FLOPs per attended (query, key) pair and per (head, channel), forward + backward.
FLOPS_PER_PAIR_CHANNEL = 14


def document_pairs(length: int, block: int, top_k: int) -> tuple[int, int]:
    """``(dense, sparse)`` causal (query, key) pairs of one document of ``length`` tokens:
    every visible key, and at most ``top_k`` blocks of ``block`` keys (the own block partial),
    i.e. ``min(p + 1, (top_k - 1) * block + p % block + 1)`` per query (an upper bound on any
    selection's pairs)."""
    p = torch.arange(length, dtype=torch.int64)
    dense = length * (length + 1) // 2
    sparse = int(torch.minimum(p + 1, (top_k - 1) * block + p % block + 1).sum())
    return dense, sparse


def dense_pairs(lengths) -> int:
    """Causal (query, key) pairs per head of dense attention within documents of ``lengths``."""
    return sum(n * (n + 1) // 2 for n in lengths)


def selected_pairs(q2k: torch.Tensor, msa) -> float:
    """(query, key) pairs per query head that a selection attends, exactly.

    The q2k means its set (MSA_SPEC.md): :func:`canonical_q2k` drops -1, ids past the token's
    own block and duplicates first, as the kernels do. Each query head attends its KV head's
    selection, so the pairs summed over the query heads, divided by Hq, are the mean over the
    KV heads.

    Args:
        q2k: int [Hkv, T, top_k] document-local block ids (every token a query).
        msa: the layout (``document_positions``, ``block_size``).

    Returns:
        The pairs per query head (the mean over KV heads; a float).
    """
    ids = canonical_q2k(q2k, msa).long()  # [Hkv, T, K], -1 for an empty slot
    positions = msa.document_positions.long()[None, :, None]
    # A block's visible keys: up to the query in its own block, all of an earlier one.
    keys = (positions - ids * msa.block_size + 1).clamp(max=msa.block_size)
    return torch.where(ids >= 0, keys, 0).sum().item() / q2k.shape[0]


def dense_prefix(q2k: torch.Tensor, msa) -> tuple[torch.Tensor, list[int]] | None:
    """The tokens whose selection is every visible block of their document (on every KV head):
    MSA computes dense attention for them, so cuDNN could serve them (issue #50, item 3).

    Args:
        q2k: int [Hkv, T, top_k] document-local block ids (every token a query).
        msa: the layout (``document_positions``, ``document_lengths``, ``block_size``).

    Returns:
        ``(rows, lengths)``: int64 [P] compact rows of those tokens, and per document the
        length of its dense prefix (its first tokens); None where they are not each document's
        first tokens (a selection that skips a visible block early and keeps all later).
    """
    ids = canonical_q2k(q2k, msa).long()
    own = msa.document_positions.long() // msa.block_size
    dense = ((ids >= 0).sum(-1) == own[None, :] + 1).all(0)
    positions = msa.document_positions.long()
    lengths, start = [], 0
    for n in msa.document_lengths:
        m = int(dense[start:start + n].sum())
        if m and int(positions[start:start + n][dense[start:start + n]].max()) != m - 1:
            return None
        lengths.append(m)
        start += n
    return torch.nonzero(dense).flatten(), lengths


def tflops(pairs: float, heads: int, head_dim: int, ms: float) -> float:
    """TFLOP/s of ``pairs`` per head over ``heads`` heads of ``head_dim``, forward + backward
    in ``ms``."""
    return FLOPS_PER_PAIR_CHANNEL * heads * head_dim * pairs / (ms * 1e-3) / 1e12


def _leaves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """A timed call's ``prepare``: detached clones of q/k/v with gradients, and a fresh random
    gradient of the output."""
    def prepare() -> dict:
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        return dict(zip("qkv", leaves, strict=True), dout=torch.randn_like(leaves[0]))
    return prepare


def _msa_backward(call: CoreAttentionCall, kwargs: dict, view: QueryView | None = None):
    """A timed call's ``run``: the captured core attention with ``kwargs`` (on ``view``, by
    default the call's), forward + backward of its output (the block mass, where asked for,
    has no gradient)."""
    def run(x: dict) -> None:
        out = call.module(x["q"], x["k"], x["v"], call.args[3] if view is None else view,
                          **kwargs)
        if kwargs.get("return_block_mass"):
            out = out[0]
        out.backward(x["dout"])
    return run


def _cudnn_backward(lengths, scale: float):
    """A timed call's ``run``: cuDNN SDPA per document of ``lengths``, forward + backward."""
    def run(x: dict) -> None:
        cudnn_document_attention(x["q"], x["k"], x["v"], lengths, scale).backward(x["dout"])
    return run


def pair_rate(call: CoreAttentionCall, on_gpu: bool, warmup: int, reps: int) -> dict:
    """The MSA layer's sparse attention against cuDNN's dense attention, per attended pair.

    Both sides run forward + backward on detached clones (with gradients) of the captured
    q/k/v and a fresh random gradient of the output per call, timed by the rows' helper
    (:func:`run_timed`: ``warmup`` calls, then the median of ``reps``). The sparse side is the
    captured call itself (the module, the layout, the q2k object, ``return_block_mass`` and the
    backend as training passed them); the dense side is cuDNN SDPA per document of the same
    layout (the math kernel on the CPU).

    Args:
        call: the first MSA layer's core-attention call (:func:`capture_core_attention`).
        on_gpu: time with CUDA events (perf_counter on the CPU).
        warmup: untimed calls per side first (>= 1; cuDNN plans each document length there).
        reps: timed calls per side.

    Returns:
        ``pairs_dense``, ``pairs_msa`` (per query head), ``msa_attention_ms``,
        ``cudnn_attention_ms``, ``pair_rate_vs_cudnn`` (MSA pairs per ms over cuDNN's) and
        ``msa_attention_tflops``, ``cudnn_attention_tflops``. Where some but not all tokens
        select every visible block (:func:`dense_prefix`), the same split in two query subsets
        of the captured call: ``prefix_tokens``, ``pairs_msa_prefix``, ``msa_prefix_ms``
        (those tokens alone), ``msa_rest_ms`` (the others), ``cudnn_prefix_ms`` (cuDNN on the
        prefixes alone), ``prefix_pair_rate_vs_cudnn`` (cuDNN's time over MSA's on the same
        pairs) and ``rest_pair_rate_vs_cudnn`` (the others' pairs per ms over the whole row's
        cuDNN rate): what serving the prefixes by cuDNN could save, before the block-mass pass
        it would need.

    Raises:
        ValueError: a call with a query subset (context parallelism), whose pairs these counts
            do not cover.
    """
    query, key, value = call.args[:3]
    msa, kwargs = call.msa, call.kwargs
    if call.view.queries is not None:
        raise ValueError("pair_rate counts every token as a query; the call has a query subset")
    heads, head_dim = query.shape[1], query.shape[2]
    lengths = msa.document_lengths
    pairs = {"msa": selected_pairs(call.q2k, msa), "cudnn": dense_pairs(lengths)}

    prepare = _leaves(query, key, value)
    msa_run = _msa_backward(call, kwargs)
    cudnn_run = _cudnn_backward(lengths, call.module.softmax_scale)

    # The rows' loop, without its too-slow cut (the step around this attention already passed).
    timing = argparse.Namespace(warmup=warmup, steps=reps, max_step_s=math.inf, profile=False)

    def timed(prepare_fn, run) -> float:
        scratch: dict = {}
        run_timed((prepare_fn, run), timing, on_gpu, scratch, "ms")
        return scratch["ms"]

    ms = {"msa": timed(prepare, msa_run), "cudnn": timed(prepare, cudnn_run)}
    split = _prefix_split(call, timed, pairs, ms)
    return {
        "pairs_dense": pairs["cudnn"],
        "pairs_msa": pairs["msa"],
        "msa_attention_ms": ms["msa"],
        "cudnn_attention_ms": ms["cudnn"],
        "pair_rate_vs_cudnn": (pairs["msa"] / ms["msa"]) / (pairs["cudnn"] / ms["cudnn"]),
        "msa_attention_tflops": tflops(pairs["msa"], heads, head_dim, ms["msa"]),
        "cudnn_attention_tflops": tflops(pairs["cudnn"], heads, head_dim, ms["cudnn"]),
        **split,
    }


def _prefix_split(call: CoreAttentionCall, timed, pairs: dict, ms: dict) -> dict:
    """:func:`pair_rate`'s prefix fields (empty where the row has no split: no dense prefix,
    nothing else, or a prefix that is not each document's first tokens)."""
    query, key, value = call.args[:3]
    msa, kwargs = call.msa, call.kwargs
    found = dense_prefix(call.q2k, msa)
    if found is None or not 0 < found[0].numel() < query.shape[0]:
        return {}
    rows, prefix_lengths = found
    others = torch.ones(query.shape[0], dtype=torch.bool, device=rows.device)
    others[rows] = False
    rows, rest = rows.to(query.device), torch.nonzero(others).flatten().to(query.device)

    def subset(which: torch.Tensor):
        # A row slice of a canonical selection is canonical, so the timed op does not sort it
        # again (as training would not).
        canonical = getattr(kwargs["q2k"], "canonical", False)
        rows_of = Selection(call.q2k[:, which].contiguous(), msa.block_size, canonical)
        return (_leaves(query[which], key, value),
                _msa_backward(call, {**kwargs, "q2k": rows_of}, QueryView(msa, which)))

    prefix_pairs = dense_pairs(prefix_lengths)
    msa_prefix = timed(*subset(rows))
    msa_rest = timed(*subset(rest))
    cudnn_prefix = timed(_leaves(query[rows], key[rows], value[rows]),
                         _cudnn_backward([m for m in prefix_lengths if m],
                                         call.module.softmax_scale))
    return {
        "prefix_tokens": int(rows.numel()),
        "pairs_msa_prefix": prefix_pairs,
        "msa_prefix_ms": msa_prefix,
        "msa_rest_ms": msa_rest,
        "cudnn_prefix_ms": cudnn_prefix,
        "prefix_pair_rate_vs_cudnn": cudnn_prefix / msa_prefix,
        "rest_pair_rate_vs_cudnn": ((pairs["msa"] - prefix_pairs) / msa_rest)
        / (pairs["cudnn"] / ms["cudnn"]),
    }
