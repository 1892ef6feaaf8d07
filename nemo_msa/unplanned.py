"""Choices made per call for want of a plan, counted.

A layer's :class:`nemo_msa.plan.MSAPlan` names every kernel the layer runs, and the ops and
helpers read it. A direct caller that passes no plan (``sparse_attention(backend="triton")``, a
helper called on its own) has the choice made per call from its inputs instead; each such
choice is counted here, by decision point, so that a test can assert that a layer's training
step makes none (tests/megatron/test_megatron_plan.py).
"""

from __future__ import annotations

from collections import Counter

__all__ = ["counts", "record", "reset"]

_COUNTS: Counter[str] = Counter()


def record(point: str) -> None:
    """Counts one choice made per call at ``point`` (a kernel or helper name)."""
    _COUNTS[point] += 1


def counts() -> dict[str, int]:
    """The choices made per call since the last :func:`reset`, by decision point."""
    return dict(_COUNTS)


def reset() -> None:
    """Forgets the counts."""
    _COUNTS.clear()
