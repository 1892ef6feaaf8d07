"""Where FP8 stops inside an MSA layer: the indexer's projections run in bf16 (ADR 0036).

With ``config.fp8`` Megatron runs every Transformer Engine linear of a layer inside TE's FP8
autocast. The indexer's two projections are excluded, in both directions of training:

- the selection ranks blocks by the max of index q.k over each block, and a small relative change
  of the scores reorders near-tied blocks, so index q and k keep bf16 GEMMs;
- they project the compact real tokens of a microbatch, whose count is arbitrary, while TE's FP8
  GEMMs need a row count divisible by 16;
- they are about 1% of the layer's GEMM FLOPs at MiniMax-M3 shape (hidden -> 4 x 128 and
  hidden -> 128, against QKV, output projection and the FFN), so bf16 costs nothing measurable.

With ``config.fp8_param`` they are also built outside TE's quantized-parameter init, so their
weights stay high-precision parameters. Without FP8 both contexts are no-ops, and TE is imported
only where FP8 asks for it (the local spec runs without TE).
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["high_precision_gemms", "high_precision_init"]


def _te_pytorch():
    import transformer_engine.pytorch as te

    return te


def high_precision_gemms(config: Any) -> contextlib.AbstractContextManager:
    """A context in which TE linears compute in their parameters' precision, not FP8.

    Args:
        config: the layer's TransformerConfig (reads ``fp8``).

    Returns:
        TE's ``autocast(enabled=False)`` (``fp8_autocast`` before TE 2.8) where ``config.fp8``
        is set, else a null context.
    """
    if not getattr(config, "fp8", None):
        return contextlib.nullcontext()
    te = _te_pytorch()
    autocast = getattr(te, "autocast", None)
    if autocast is not None:
        return autocast(enabled=False)
    return te.fp8_autocast(enabled=False)


def high_precision_init(config: Any) -> contextlib.AbstractContextManager:
    """A context in which TE linears are built with high-precision weights.

    Args:
        config: the layer's TransformerConfig (reads ``fp8_param``).

    Returns:
        TE's ``quantized_model_init(enabled=False)`` (``fp8_model_init`` before TE 2.8) where
        ``config.fp8_param`` is set, else a null context.
    """
    if not getattr(config, "fp8_param", False):
        return contextlib.nullcontext()
    te = _te_pytorch()
    init = getattr(te, "quantized_model_init", None)
    if init is not None:
        return init(enabled=False)
    return te.fp8_model_init(enabled=False)
