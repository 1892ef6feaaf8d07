"""The contract's limits and the small checks and conventions every layer of the package shares.

The bottom of the package (ADR 0017): no ``nemo_msa`` imports, so the layout, the kernels and
references, the ops and the construction gate can all read it without an import running back up.

- the supported shapes: :data:`SUPPORTED_HEAD_DIMS`, :data:`SUPPORTED_BLOCK_SIZES`,
  :data:`SUPPORTED_SCORE_TYPES`, :data:`MAX_TOP_K`;
- :func:`is_integer` / :func:`require_integer`: a float such as 32.0 is not an integer;
- :func:`accumulation_dtype`: the precision the plain-PyTorch references accumulate in.
"""

from __future__ import annotations

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
    "require_integer",
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


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (the tight oracle), fp32 for everything else."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
