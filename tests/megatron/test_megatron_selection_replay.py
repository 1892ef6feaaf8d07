"""Activation recompute of MSA layers on one CPU rank: bitwise the model without recompute, with
the block selection scored once per layer and microbatch (ADR 0028).

Full recompute (uniform and block methods) runs every checkpointed layer twice; the first forward
records its layout and selection and the recompute takes them back. Selective recompute of the
core attention keeps the selection in the layer. In every case the per-token LM losses, the
logged indexer loss and recall, and every parameter's gradient equal those of the same model
without recompute exactly (fp32, reference backend).
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from _megatron_harness import (
    MICRO_BATCH,
    SEQ,
    build_model_chunks,
    deterministic_init,
    packed_batches,
    tiny_config,
)
from megatron.core import tensor_parallel

from nemo_msa import MSAMicrobatch
from nemo_msa.megatron import (
    MSAIndexerLossAutoScaler,
    MSAIndexerMetrics,
    SelectionReplay,
    clear_selection_replay,
    msa_attention,
    set_training_iteration,
)
from nemo_msa.megatron.selection_replay import ReplayEntry, recompute_phase

pytestmark = pytest.mark.usefixtures("single_rank")

FULL_UNIFORM = dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
)
RECOMPUTE = {
    "full-uniform-1": FULL_UNIFORM,
    # Two layers per checkpointed chunk: the second one's input is recomputed, not saved.
    "full-uniform-2": dict(FULL_UNIFORM, recompute_num_layers=2),
    # The first two layers checkpointed, the last two not.
    "full-block-2": dict(FULL_UNIFORM, recompute_method="block", recompute_num_layers=2),
    "selective-core-attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    # Megatron's other selective modules are not run here: "layernorm" fails without Transformer
    # Engine (Megatron-Core 0.19.2's CheckpointWithoutOutput() takes its FP8 path: fp8=False is
    # "not None"), and "mlp" alone recurses without end in the backward on the CPU (reentrant
    # CheckpointFunction.backward; selection replay or not).
}
LOSSES = {
    "dense-loss": {},
    # The plan takes the sparse loss from the selection's scores and keys (recorded too).
    "sparse-loss": {"msa_indexer_loss_type": "sparse"},
    "loss-off": {"msa_indexer_loss_coeff": 0.0},
}
MSA_LAYERS = 3  # tiny_config's pattern "SDSS"


def _model(**overrides):
    (model,) = build_model_chunks(tiny_config(**overrides))
    deterministic_init([model])
    return model


def _batches(device: str = "cpu"):
    """Three microbatches; the third reuses the first one's document-map tensor (a shared key,
    matched in first-forward order)."""
    first, second, third = (
        {k: v.to(device) for k, v in b.items()} for b in packed_batches(3, seed=21))
    third["packed_seq_ids"] = first["packed_seq_ids"]
    third["loss_mask"] = first["loss_mask"]
    return [first, second, third]


def _forward(model, batch):
    positions = torch.arange(SEQ, device=batch["tokens"].device).expand(MICRO_BATCH, SEQ)
    out = model(batch["tokens"], positions, batch["packed_seq_ids"], labels=batch["labels"])
    mask = batch["loss_mask"]
    return out, (out * mask).sum() / mask.sum()


def _stores(model):
    return [m.selection_replay for m in model.modules()
            if isinstance(m, msa_attention.MSASelfAttention)]


def _run(model, batches, monkeypatch, backward_order=(1, 0, 2)):
    """Every forward first, then the backwards in ``backward_order`` (microbatch 1 before 0:
    keyed matching; 0 before 2, which share a key: first-forward order). Returns what must not
    change under recompute, and the counts."""
    calls = []
    select = msa_attention.select
    monkeypatch.setattr(msa_attention, "select",
                        lambda *a, **k: calls.append(1) or select(*a, **k))
    model.zero_grad(set_to_none=True)
    MSAIndexerLossAutoScaler.reset()
    MSAIndexerMetrics.reset()
    builds = MSAMicrobatch.num_builds()
    outputs = [_forward(model, batch) for batch in batches]
    pending = sum(len(store) for store in _stores(model))
    for index in backward_order:
        outputs[index][1].backward()
    return {
        "per_token": [out.detach() for out, _ in outputs],
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "metrics": MSAIndexerMetrics.pop(reduce=False),
        "selections": len(calls),
        "builds": MSAMicrobatch.num_builds() - builds,
        "pending_after_forward": pending,
        "pending_after_backward": sum(len(store) for store in _stores(model)),
        "taken": sum(store.num_taken for store in _stores(model)),
    }


def _assert_bitwise(run, reference):
    for out, ref in zip(run["per_token"], reference["per_token"], strict=True):
        assert torch.equal(out, ref), float((out - ref).abs().max())
    assert set(run["grads"]) == set(reference["grads"])
    for name, ref in reference["grads"].items():
        grad = run["grads"][name]
        assert (grad is None) == (ref is None), name
        if ref is not None:
            assert torch.equal(grad, ref), (name, float((grad - ref).abs().max()))
    assert run["metrics"] == reference["metrics"]


CASES = [
    ("full-uniform-1", "dense-loss"),
    ("full-uniform-1", "sparse-loss"),
    ("full-uniform-1", "loss-off"),
    ("full-uniform-2", "sparse-loss"),
    ("full-block-2", "dense-loss"),
    ("selective-core-attn", "sparse-loss"),
    ("selective-core-attn", "loss-off"),
]
_REFERENCES: dict[str, dict] = {}


@pytest.mark.parametrize(("recompute", "loss"), CASES, ids=[f"{r}-{x}" for r, x in CASES])
def test_recompute_is_bitwise_the_model_without_it(monkeypatch, recompute, loss):
    # Fresh batch tensors per run: no layout memoized on them yet.
    if loss not in _REFERENCES:
        _REFERENCES[loss] = _run(_model(**LOSSES[loss]), _batches(), monkeypatch)
    reference = _REFERENCES[loss]
    run = _run(_model(**LOSSES[loss], **RECOMPUTE[recompute]), _batches(), monkeypatch)
    _assert_bitwise(run, reference)
    if loss != "loss-off":
        assert "indexer_loss" in run["metrics"] and "selection_recall" in run["metrics"]
    # Scored once per MSA layer and microbatch; one layout per document-map tensor (two).
    assert reference["selections"] == run["selections"] == MSA_LAYERS * 3
    assert reference["builds"] == run["builds"] == 2
    assert run["pending_after_backward"] == 0
    if recompute.startswith("full"):
        recomputed_layers = 2 if recompute == "full-block-2" else 4
        assert run["pending_after_forward"] == run["taken"] == recomputed_layers * 3
    else:
        assert run["pending_after_forward"] == run["taken"] == 0


def test_recompute_in_the_dense_warmup(monkeypatch):
    """The warm-up attends densely; its selection feeds only the recall metric, scored in the
    recompute (the first forward, without grad, logs nothing)."""
    set_training_iteration(0)
    try:
        reference = _run(_model(msa_dense_warmup_steps=5), _batches(), monkeypatch)
        run = _run(_model(msa_dense_warmup_steps=5, **FULL_UNIFORM), _batches(), monkeypatch)
    finally:
        set_training_iteration(None)
    _assert_bitwise(run, reference)
    assert "selection_recall" in run["metrics"]
    assert reference["selections"] == run["selections"] == MSA_LAYERS * 3


def test_a_failed_step_leaves_nothing_for_the_next(monkeypatch):
    """A forward that raises in the last layer's core attention leaves every layer's entry. The next
    step (new weights, the same batch tensors) must not replay them: the step boundary
    (set_training_iteration) or clear_selection_replay drops them; without either, the stale
    selection is replayed and the gradients differ (the control)."""
    batches = _batches()[:1]

    def perturb(model):
        # An "optimizer step" that changes the selection.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".indexer." in name:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.5)

    def failed_then_retried(boundary: str):
        model = _model(**LOSSES["sparse-loss"], **FULL_UNIFORM)
        last = model.decoder.layers[3].self_attention.core_attention
        monkeypatch.setattr(last, "forward", lambda *a, **k: (_ for _ in ()).throw(
            RuntimeError("out of memory (simulated)")))
        set_training_iteration(0)
        with pytest.raises(RuntimeError, match="simulated"):
            _forward(model, batches[0])
        monkeypatch.undo()
        assert sum(len(store) for store in _stores(model)) == 4
        perturb(model)
        if boundary == "iteration":
            set_training_iteration(1)
        elif boundary == "clear":
            assert clear_selection_replay(model) == 4
        assert sum(len(store) for store in _stores(model)) == (4 if boundary == "none" else 0)
        return model

    try:
        for boundary in ("iteration", "clear", "none"):
            generator = torch.Generator().manual_seed(3)
            model = failed_then_retried(boundary)
            generator = torch.Generator().manual_seed(3)
            fresh = _model(**LOSSES["sparse-loss"])
            perturb(fresh)
            reference = _run(fresh, batches, monkeypatch, backward_order=(0,))
            run = _run(model, batches, monkeypatch, backward_order=(0,))
            if boundary == "none":
                qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
                assert not torch.equal(run["grads"][qkv], reference["grads"][qkv])
            else:
                _assert_bitwise(run, reference)
                assert run["pending_after_backward"] == 0
    finally:
        set_training_iteration(None)


def test_entries_die_with_their_microbatch():
    """A recomputed forward without a backward (the batch then dropped) leaves nothing."""
    model = _model(**FULL_UNIFORM)
    batch = packed_batches(1, seed=4)[0]
    out, loss = _forward(model, batch)
    assert sum(len(store) for store in _stores(model)) == 4
    del out, loss, batch
    gc.collect()
    assert sum(len(store) for store in _stores(model)) == 0


def test_the_phase_follows_megatrons_checkpoint():
    """First forward of tensor_parallel.checkpoint: record; its recompute: replay; elsewhere,
    another granularity or eval mode: None."""
    phases = []
    config = SimpleNamespace(recompute_granularity="full")

    def fn(x):
        phases.append((recompute_phase(config, True), recompute_phase(config, False),
                       recompute_phase(SimpleNamespace(recompute_granularity="selective"), True)))
        return x * 2

    x = torch.ones(3, requires_grad=True)
    y = tensor_parallel.checkpoint(fn, False, x)
    assert recompute_phase(config, True) is None
    y.sum().backward()
    assert phases == [("record", None, None), ("replay", None, None)]
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_the_store_matches_aliases_and_refuses_what_it_cannot_replay():
    store = SelectionReplay()
    ids = torch.ones(2, 8, dtype=torch.int64)
    other = torch.ones(2, 8, dtype=torch.int64)
    store.record(ids, ReplayEntry("layout-a", None, 8, 2))
    store.record(other, ReplayEntry("layout-b", None, 8, 2))
    store.record(None, ReplayEntry("layout-c", None, 8, 2))
    # The recompute gets a detached alias: same storage and version, another object.
    assert store.take(other.detach(), 8, 2).layout == "layout-b"
    assert store.take(None, 8, 2).layout == "layout-c"
    with pytest.raises(RuntimeError, match=r"\[s=8, b=2\].*\[s=4, b=2\]"):
        store.take(ids.detach(), 4, 2)
    store.record(ids, ReplayEntry("layout-a", None, 8, 2))
    ids.add_(0)  # an in-place write: the layout recorded for it is stale
    with pytest.raises(RuntimeError, match="no selection recorded"):
        store.take(ids.detach(), 8, 2)
    with pytest.raises(RuntimeError, match="no selection recorded"):
        store.take(torch.ones(2, 8, dtype=torch.int64), 8, 2)
    assert store.num_recorded == 4 and store.num_taken == 2


def test_thd_input_replays_through_the_packed_seq_params():
    """THD input has no attention_mask: the recompute finds its entries through
    packed_seq_params.cu_seqlens_q, which Megatron's checkpoint closure hands back as is."""
    from _megatron_harness import VOCAB, _thd_step, count_selections

    tokens = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(3))
    results = []
    for recompute in ({}, FULL_UNIFORM):
        model = _model(**recompute)
        with count_selections() as counts:
            step = _thd_step(model, tokens, 1, 0, None)
        results.append((step, {n: p.grad for n, p in model.named_parameters()}, counts))
        assert sum(len(store) for store in _stores(model)) == 0
    (plain, plain_grads, plain_counts), (run, run_grads, run_counts) = results
    assert torch.equal(run["per_token"], plain["per_token"]) and run["loss"] == plain["loss"]
    for name, ref in plain_grads.items():
        assert torch.equal(run_grads[name], ref), name
    assert run_counts["selections"] == plain_counts["selections"] == MSA_LAYERS
    assert run_counts["max_in_flight"] == 1 and plain_counts["max_in_flight"] == 0
