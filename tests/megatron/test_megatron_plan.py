"""Each MSA layer resolves its plan once, when it is built (ADR 0019): a training step looks up
no backend, and a shape the backend cannot run is refused at construction by its capability
record, naming the config field."""

from __future__ import annotations

import collections

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

from nemo_msa import ops, plan
from nemo_msa.backends import registry as backends
from nemo_msa.backends.capabilities import REFERENCE, MSACapabilities
from nemo_msa.megatron import MSAIndexerMetrics
from nemo_msa.support import MSATopology
from nemo_msa.testing.op_count import OpCounter

pytestmark = pytest.mark.usefixtures("single_rank")


@pytest.fixture
def registry_calls(monkeypatch):
    """Counts every registry lookup (``_load``: the one way to a backend by name, which
    ``get_backend`` and ``resolve_backend`` both take) and every resolution, wherever it is
    called from."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    calls = {"load": 0, "resolve": 0}
    load, resolve = backends._load, backends.resolve_backend

    def counting_load(name):
        calls["load"] += 1
        return load(name)

    def counting_resolve(*args, **kwargs):
        calls["resolve"] += 1
        return resolve(*args, **kwargs)

    monkeypatch.setattr(backends, "_load", counting_load)
    for module in (backends, ops, plan):
        monkeypatch.setattr(module, "resolve_backend", counting_resolve)
    return calls


@pytest.fixture
def range_checks(monkeypatch):
    """Counts every config-level range check, wherever it is called from: the topology's
    (``MSATopology.validate``), the backends' capability records (``why_not``,
    ``why_not_fused_dense_loss``), the config's own (``_validate_msa_fields``) and its layer
    pattern and MoE frequency parsers."""
    from nemo_msa.megatron import config as config_module

    calls = collections.Counter()

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    for owner, name in ((MSATopology, "validate"), (MSACapabilities, "why_not"),
                        (MSACapabilities, "why_not_fused_dense_loss"),
                        (config_module.MSATransformerConfig, "_validate_msa_fields"),
                        (config_module, "normalize_layer_pattern"),
                        (config_module, "normalize_moe_layer_freq")):
        monkeypatch.setattr(owner, name, counting(name, getattr(owner, name)))
    return calls


def _attention_layers(model):
    return [layer.self_attention for layer in model.decoder.layers]


def _training_step(model) -> None:
    """One forward + backward of a packed microbatch; checks that the indexer loss ran."""
    MSAIndexerMetrics.reset()
    batch = packed_batches(1)[0]
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    model.train()
    loss = model(batch["tokens"], positions, batch["packed_seq_ids"], labels=batch["labels"])
    (loss * batch["loss_mask"]).sum().backward()
    assert "indexer_loss" in MSAIndexerMetrics.pop(num_layers=4)  # the loss path ran


def test_a_training_step_resolves_the_backend_zero_times(registry_calls):
    """Construction resolves one plan per layer; the forward and backward of a step (sparse
    layers with selection, the indexer loss from by-products, a dense layer) then make no
    registry lookup at all."""
    (model,) = build_model_chunks(tiny_config(msa_indexer_loss_coeff=0.1,
                                              msa_indexer_loss_type="sparse",
                                              msa_log_selection_recall=True))
    deterministic_init([model])
    layers = _attention_layers(model)
    assert registry_calls["resolve"] == len(layers), registry_calls  # one plan per layer
    assert all(layer.msa_plan.backend.name == "reference" for layer in layers)
    assert [layer.msa_plan.loss_from_byproducts for layer in layers] == [True] * len(layers)
    registry_calls.update(load=0, resolve=0)
    _training_step(model)
    assert registry_calls == {"load": 0, "resolve": 0}, (
        f"a training step looked the backend up: {registry_calls}")


@pytest.mark.parametrize("loss_type", ["sparse", "dense"])
def test_a_training_step_runs_zero_range_checks(range_checks, loss_type):
    """The config's ranges are checked when it is made and when each layer is built (its plan);
    the forward and backward of a step (selection, core attention, the indexer loss on either
    route, the recall, a dense layer) read the plan and check no range again."""
    config = tiny_config(msa_indexer_loss_coeff=0.1, msa_indexer_loss_type=loss_type,
                         msa_log_selection_recall=True)
    (model,) = build_model_chunks(config)
    deterministic_init([model])
    assert range_checks["validate"] >= 1 + len(_attention_layers(model)), range_checks
    range_checks.clear()
    _training_step(model)
    assert not range_checks, f"a training step checked config ranges: {dict(range_checks)}"


def _build_attention(config):
    from megatron.core.transformer.spec_utils import build_module

    from layer_specs import get_msa_self_attention_spec

    spec = get_msa_self_attention_spec(config, sparse=True, transformer_impl="local")
    return build_module(spec, config=config, layer_number=1)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize(("changes", "field"), [
    (dict(msa_score_type="lse"), "msa_score_type='lse'"),
    (dict(kv_channels=256, msa_index_head_dim=32), "kv_channels=256"),
    (dict(msa_index_head_dim=256), "msa_index_head_dim=256"),
    (dict(msa_block_size=256), "msa_block_size=256"),
    (dict(bf16=False), "params dtype torch.float32"),
])
def test_the_kernel_backends_refuse_at_construction_naming_the_field(
        kernel_backends_on_the_cpu, backend, changes, field):
    changes = {"bf16": True, **changes}
    config = tiny_config(msa_backend=backend, **changes)
    with pytest.raises(ValueError, match=f"backend={backend!r}: the {backend} backend cannot "
                                         f"run {field}"):
        _build_attention(config)
    # The same config on the reference backend builds (its record holds the whole contract).
    layer = _build_attention(tiny_config(msa_backend="reference", **changes))
    assert layer.msa_plan.backend.name == "reference"


def test_the_reference_backend_refuses_at_construction_naming_the_field():
    """The reference record is the contract (nemo_msa.limits): what it refuses no backend
    runs; the layer is refused when it is built, even where the config was changed after its
    own checks."""
    assert "msa_topk=33" in REFERENCE.why_not(top_k=33)
    assert "msa_block_size=512" in REFERENCE.why_not(block_size=512)
    config = tiny_config(msa_backend="reference")
    config.msa_topk = 33  # bypasses __post_init__
    with pytest.raises(ValueError, match="msa_topk=33"):
        _build_attention(config)
    config = tiny_config(msa_backend="reference")
    config.msa_block_size = 512
    with pytest.raises(ValueError, match="msa_block_size=512"):
        _build_attention(config)


def test_the_plan_reads_the_environment_variable_once(monkeypatch, registry_calls):
    monkeypatch.setenv(backends.ENV_VAR, "reference")
    layer = _build_attention(tiny_config(msa_backend="auto"))
    assert layer.msa_plan.backend.name == "reference"
    monkeypatch.setenv(backends.ENV_VAR, "nonexistent")  # too late: the plan is resolved
    assert layer.msa_plan.backend.name == "reference"


def _triton_launches_of_a_layer_step(config) -> collections.Counter:
    """The Triton kernels one forward + backward of an MSA layer launches (bf16, the sparse
    indexer loss from by-products with the sampled recall, q/k norms, RoPE), by kernel name."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    torch.manual_seed(0)
    layer = _build_attention(config).to(torch.bfloat16).train()
    # One row of three packed documents and padding (the interpreter's cost grows with it).
    hidden = torch.randn(SEQ, 1, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    ids = packed_batches(1)[0]["packed_seq_ids"][:1]
    rotary = RotaryEmbedding(config.kv_channels, rotary_percent=0.5, rotary_base=5_000_000)(SEQ)
    with OpCounter() as ops:
        out, _ = layer(hidden, ids, rotary_pos_emb=rotary)
        out.float().square().sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad.float()).all()
    return ops.triton_launches()


_LAYER_STEP = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                   qk_layernorm=True, msa_indexer_loss_coeff=0.1, msa_indexer_loss_type="sparse",
                   msa_log_selection_recall=True)


def test_the_reference_backend_runs_no_triton_kernel_in_a_layer_step():
    """msa_backend="reference" means plain PyTorch everywhere in the layer: its plan turns the
    fused helpers off (norms, RoPE, the by-product loss's passes, the recall, the dense path),
    so a bf16 training step launches no Triton kernel, even under the interpreter, where every
    helper deciding from the device alone would launch its kernel."""
    layer_plan = _build_attention(tiny_config(msa_backend="reference", **_LAYER_STEP)).msa_plan
    assert layer_plan.backend.name == "reference" and not layer_plan.fused_helpers
    launches = _triton_launches_of_a_layer_step(tiny_config(msa_backend="reference",
                                                            **_LAYER_STEP))
    assert not launches, f"the reference backend launched Triton kernels: {dict(launches)}"


def test_the_triton_backend_runs_the_fused_helpers_in_a_layer_step(kernel_backends_on_the_cpu):
    """The same step on the Triton backend (its device check doubled on the CPU; the
    interpreter runs the kernels) launches the helpers' kernels as well as the ops'."""
    launches = _triton_launches_of_a_layer_step(tiny_config(msa_backend="triton", **_LAYER_STEP))
    helpers = {"_rms_fwd_kernel", "_rms_bwd_kernel", "_rope_kernel", "_block_scores_kernel",
               "_sparse_kl_fwd_kernel", "_recall_kernel"}
    assert helpers <= set(launches), dict(launches)
