"""The contract's limits and the small checks and conventions every layer of the package shares.

The bottom of the package (ADR 0017): no ``nemo_msa`` imports, so the layout, the kernels and
references, the ops and the construction gate can all read it without an import running back up.

- the supported shapes: :data:`SUPPORTED_HEAD_DIMS`, :data:`SUPPORTED_BLOCK_SIZES`,
  :data:`SUPPORTED_SCORE_TYPES`, :data:`MAX_TOP_K`;
- :func:`is_integer` / :func:`require_integer`: a float such as 32.0 is not an integer;
- :func:`require_float_tensor` / :func:`require_softmax_scale`: the ops' argument checks that
  come before any shape is compared (a string, an integer tensor, a zero-sized head);
- :func:`accumulation_dtype`: the precision the plain-PyTorch references accumulate in.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = [
    "MAX_TOP_K",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_SCORE_TYPES",
    "accumulation_dtype",
    "is_integer",
    "require_float_tensor",
    "require_integer",
    "require_softmax_scale",
]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128, 256)
SUPPORTED_SCORE_TYPES = ("max", "lse")
MAX_TOP_K = 32


def is_integer(value: Any) -> bool:
    """True for Python and NumPy integers, False for bools, floats (even 32.0) and the rest."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_integer(name: str, value: Any) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an integer (not a float or bool).

    A float such as 32.0 would pass a range or membership check (32.0 == 32) and fail later as
    a shape or an index; it is refused here instead.
    """
    if not is_integer(value):
        raise ValueError(f"{name}={value!r} must be an integer; got {type(value).__name__}")


def require_float_tensor(name: str, value: Any, layout: str) -> None:
    """Refuse what no op can attend with, naming the argument: not a tensor (TypeError), not a
    floating-point dtype (integer, bool, complex), or a zero-sized dimension after the first.

    Args:
        name: the argument's name in the message.
        value: the argument.
        layout: its documented shape, e.g. ``"[tokens, heads, dim]"`` (rank checked elsewhere).

    Raises:
        TypeError: ``value`` is not a torch.Tensor.
        ValueError: its dtype is not floating point, or a head or feature dimension is 0.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}; got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise ValueError(f"{name} has dtype {value.dtype}; expected a floating-point tensor "
                         f"{layout} (bf16, fp16, fp32 or fp64)")
    if value.dim() >= 2 and 0 in value.shape[1:]:
        raise ValueError(f"{name} has shape {tuple(value.shape)} {layout}; expected every "
                         "dimension after the tokens to be at least 1")


def require_softmax_scale(value: Any) -> None:
    """Refuse a softmax scale that is not a finite positive real number (None: the default).

    Raises:
        TypeError: a string, a bool, a tensor or another non-real value.
        ValueError: NaN, an infinity, zero or a negative number.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"softmax_scale={value!r} ({type(value).__name__}); expected a finite "
                        "positive float, or None for 1/sqrt(head_dim)")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale={value!r}; expected a finite positive float, or None "
                         "for 1/sqrt(head_dim)")


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (the tight oracle), fp32 for everything else."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
