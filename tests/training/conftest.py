"""Fixtures of the training tests."""

from __future__ import annotations

import pytest
from _runs import REFERENCE, train


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """6 steps (2 of dense warm-up), checkpoints at 3 and 6: the uninterrupted curve.

    Returns:
        ``(checkpoint root, summary)``; tests copy checkpoints out of the root, never change it.
    """
    root = tmp_path_factory.mktemp("reference")
    summary = train([*REFERENCE, f"checkpoint.save={root}", "checkpoint.save_interval=3"])
    return root, summary
