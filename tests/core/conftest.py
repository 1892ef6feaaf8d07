"""Fixtures shared by the core tests."""

from __future__ import annotations

import flashinfer_double
import pytest

from nemo_msa.attention import flashinfer_adapter as fa


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """Installs the double at the adapter's import point; returns the list of its calls."""
    calls = []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return flashinfer_double.msa_sparse_attention(*args, **kwargs)

    monkeypatch.setattr(fa, "load_msa_sparse_attention", lambda: recording)
    return calls
