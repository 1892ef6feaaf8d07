"""Activation recompute of MSA layers in bf16 with the Triton backend on one GPU: bitwise the
model without recompute, the selection scored once per layer and microbatch (ADR 0028).

On the H200: ``python -m pytest -q -m gpu tests/megatron/test_megatron_selection_replay_gpu.py``.
The comparison means something only if the model without recompute is deterministic (the Triton
backward is); the reference runs twice and the test says so when it is not. Every layer is an MSA
layer here (a dense layer would run cuDNN's attention, whose backward need not be deterministic).
"""

from __future__ import annotations

import pytest
import torch
from _megatron_harness import build_model_chunks, deterministic_init, tiny_config
from test_megatron_selection_replay import (
    LOSSES,
    RECOMPUTE,
    _assert_bitwise,
    _batches,
    _run,
)

pytestmark = pytest.mark.gpu

CASES = [
    ("full-uniform-1", "sparse-loss"),
    ("full-uniform-1", "dense-loss"),
    ("full-block-2", "sparse-loss"),
    ("full-uniform-2", "loss-off"),
    ("selective-core-attn", "sparse-loss"),
]


def _model(**overrides):
    from megatron.core.transformer.module import Float16Module

    config = tiny_config(bf16=True, params_dtype=torch.bfloat16, msa_backend="triton",
                         msa_layer_pattern="SSSS", **overrides)
    (model,) = build_model_chunks(config)
    deterministic_init([model])
    model = Float16Module(config, model.cuda()).train()
    plans = {m.msa_plan.backend.name for m in model.modules() if hasattr(m, "msa_plan")}
    assert plans == {"triton"}, plans
    return model


_REFERENCES: dict[str, dict] = {}


@pytest.mark.parametrize(("recompute", "loss"), CASES, ids=[f"{r}-{x}" for r, x in CASES])
def test_bf16_triton_recompute_is_bitwise_the_model_without_it(
    cuda_single_rank, monkeypatch, recompute, loss
):
    if loss not in _REFERENCES:
        first = _run(_model(**LOSSES[loss]), _batches("cuda"), monkeypatch)
        again = _run(_model(**LOSSES[loss]), _batches("cuda"), monkeypatch)
        try:
            _assert_bitwise(again, first)
        except AssertionError as error:
            pytest.fail(f"the model without recompute is not deterministic on this GPU ({loss}):"
                        f" {error}")
        _REFERENCES[loss] = first
    reference = _REFERENCES[loss]
    run = _run(_model(**LOSSES[loss], **RECOMPUTE[recompute]), _batches("cuda"), monkeypatch)
    _assert_bitwise(run, reference)
    assert reference["selections"] == run["selections"] == 4 * 3  # 4 MSA layers, 3 microbatches
    assert run["pending_after_backward"] == 0
    if recompute.startswith("full"):
        assert run["taken"] == run["pending_after_forward"] > 0
