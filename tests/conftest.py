"""Suite-wide markers: tests marked ``gpu`` or ``te`` skip, with the reason, where unavailable."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU; runs on the device (H200) instead")
    no_te = pytest.mark.skip(reason="needs transformer-engine, which is not installed here")
    has_te = importlib.util.find_spec("transformer_engine") is not None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "te" in item.keywords and not has_te:
            item.add_marker(no_te)
