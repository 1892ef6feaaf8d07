"""The step an MSA layer could reach, counted from its own row and the dense row beside it.

Issue #60 counts the bound of one MSA layer's step as the dense layer's step with its attention
replaced by work done at cuDNN's dense rate: the dense step minus its attention (the dense
step's own attention kernels where the dense row was profiled, ``step_kernel_ms["dense
attention"]``; else cuDNN's forward + backward timed alone on the MSA row's q/k/v and documents,
``cudnn_attention_ms``), plus

- the MSA layer's attended pairs at cuDNN's rate per pair (``pairs_msa`` of ``pairs_dense``),
- the indexer's scoring (``2 * index_heads * index_dim`` FLOPs per causal pair of the
  documents, forward only: the selection has no gradient) at cuDNN's rate in FLOP/s,
- the indexer's projections (hidden -> index_heads * index_dim and hidden -> index_dim,
  forward and weight gradient: the indexer reads a detached input) at that rate too.

What the dense step holds besides its attention (GEMMs, norms, elementwise work, the LM loss)
is in both steps alike, so the bound keeps it as measured. The MSA layer's own elementwise
work (index norms, RoPE, the loss's passes) and its host time are not in the bound: a row's
``fraction_of_bound`` (bound / step) says how much of its step they and the kernels' distance
from cuDNN's rate take.
"""

from __future__ import annotations

from layer_bench.pairs import FLOPS_PER_PAIR_CHANNEL


def step_bound(msa: dict, dense_step_ms: float, heads: int, head_dim: int, index_heads: int,
               index_dim: int, hidden: int, tokens: int,
               dense_attention_ms: float | None = None) -> dict:
    """The bound of an MSA row's step (see the module docstring).

    Args:
        msa: the MSA row (``pairs_msa``, ``pairs_dense``, ``cudnn_attention_ms``, ``step_ms``;
            its ``layers`` multiplies the per-layer terms).
        dense_step_ms: the dense row's step on the same tokens and documents.
        dense_attention_ms: the dense step's own attention kernels (all its layers), where
            profiled; None takes ``layers`` times the MSA row's ``cudnn_attention_ms``.
        heads, head_dim: query heads and their dim.
        index_heads, index_dim: the indexer's heads and dim.
        hidden: the hidden size.
        tokens: the row's tokens.

    Returns:
        ``{"bound_ms", "bound_x_dense", "fraction_of_bound"}``, or ``{}`` where the row lacks
        its pair fields (``--no-pair-rate``) or its step.
    """
    need = ("pairs_msa", "pairs_dense", "cudnn_attention_ms", "step_ms")
    if any(not isinstance(msa.get(k), (int, float)) or msa[k] <= 0 for k in need):
        return {}
    layers = msa.get("layers", 1)
    attention = (dense_attention_ms / layers if dense_attention_ms
                 else msa["cudnn_attention_ms"])
    # The dense attention's rate in FLOP per ms on this row's documents (pairs_* count per
    # query head).
    attention_flops = FLOPS_PER_PAIR_CHANNEL * heads * head_dim
    rate = msa["pairs_dense"] * attention_flops / attention
    sparse_ms = msa["pairs_msa"] * attention_flops / rate
    scoring_ms = msa["pairs_dense"] * 2 * index_heads * index_dim / rate
    projection_ms = 2 * 2 * tokens * hidden * (index_heads + 1) * index_dim / rate
    bound = dense_step_ms + layers * (sparse_ms + scoring_ms + projection_ms - attention)
    return {"bound_ms": bound, "bound_x_dense": dense_step_ms / bound,
            "fraction_of_bound": bound / msa["step_ms"],
            "bound_attention_from": "dense step" if dense_attention_ms else "cudnn alone"}
