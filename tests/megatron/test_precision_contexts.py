"""nemo_msa.megatron.precision picks TE's contexts by name, the 2.8+ ones first and the older
ones where a release lacks them, always with ``enabled=False``; without the config's FP8 flags
it needs no TE at all (a double of TE stands in: these run on the CPU)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from nemo_msa.megatron import precision


def _fake_te(*names: str) -> SimpleNamespace:
    def context(name):
        return lambda **kwargs: (name, kwargs)
    return SimpleNamespace(**{name: context(name) for name in names})


@pytest.mark.parametrize(("names", "gemms", "init"), [
    (("autocast", "quantized_model_init", "fp8_autocast", "fp8_model_init"),
     "autocast", "quantized_model_init"),
    (("fp8_autocast", "fp8_model_init"), "fp8_autocast", "fp8_model_init"),
])
def test_the_te_contexts_by_release(monkeypatch, names, gemms, init):
    monkeypatch.setattr(precision, "_te_pytorch", lambda: _fake_te(*names))
    assert precision.high_precision_gemms(SimpleNamespace(fp8="hybrid")) == (
        gemms, {"enabled": False})
    assert precision.high_precision_init(SimpleNamespace(fp8_param=True)) == (
        init, {"enabled": False})


def test_without_fp8_no_te_is_asked(monkeypatch):
    monkeypatch.setattr(precision, "_te_pytorch", lambda: pytest.fail("TE was asked for"))
    assert isinstance(precision.high_precision_gemms(SimpleNamespace(fp8=None)),
                      contextlib.nullcontext)
    assert isinstance(precision.high_precision_init(SimpleNamespace(fp8_param=False)),
                      contextlib.nullcontext)
