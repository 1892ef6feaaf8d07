"""Distributed checkpoint of an MSA GPT saved at one tensor-parallel size, loaded at another."""

from __future__ import annotations

import pytest
from _megatron_harness import checkpoint_worker, spawn

pytestmark = pytest.mark.slow


def test_save_tp2_load_tp1(tmp_path):
    results = spawn(checkpoint_worker, 2, timeout=400, save_tp=2, load_tp=1, path=str(tmp_path))
    for rank, result in sorted(results.items()):
        saved, loaded, before = result["saved"], result["loaded"], result["before_load"]
        diff = max(abs(a - b) for a, b in zip(saved, loaded, strict=True))
        control = max(abs(a - b) for a, b in zip(saved, before, strict=True))
        assert diff < 1e-5, (
            f"rank {rank}: losses saved at TP=2 {saved} vs reloaded at TP=1 {loaded} "
            f"(max diff {diff:.2e})"
        )
        assert control > 1e-4, f"rank {rank}: a fresh model should differ (diff {control:.2e})"
