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
    return _te_disabled("autocast", "fp8_autocast")


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
    return _te_disabled("quantized_model_init", "fp8_model_init")


def _te_disabled(name: str, before_2_8: str) -> contextlib.AbstractContextManager:
    """TE's context ``name`` (``before_2_8`` in TE releases before 2.8) with
    ``enabled=False``."""
    te = _te_pytorch()
    return (getattr(te, name, None) or getattr(te, before_2_8))(enabled=False)

