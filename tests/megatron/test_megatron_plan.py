"""Each MSA layer resolves its plan once, when it is built (ADR 0019, ADR 0048): a training step
looks up no backend and chooses no kernel or helper outside the plan (nemo_msa.unplanned counts
zero), runs the kernels the plan names, and a shape the backend cannot run is refused at
construction by its capability record, naming the config field."""

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

from nemo_msa import ops, plan, unplanned
from nemo_msa.backends import registry as backends
from nemo_msa.backends.capabilities import REFERENCE, MSACapabilities
from nemo_msa.megatron import MSAIndexerMetrics
from nemo_msa.plan import MSAKernels
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


def test_a_training_step_makes_no_choice_outside_the_plan(registry_calls):
    """Construction resolves one plan per layer; the forward and backward of a step (sparse
    layers with selection, the indexer loss from by-products and the recall, a dense layer)
    then make no registry lookup and no per-call kernel or helper choice (every decision point
    that chooses for want of a plan counts in nemo_msa.unplanned), and run the kernels the plans
    name: on the reference backend, no Triton kernel."""
    (model,) = build_model_chunks(tiny_config(msa_indexer_loss_coeff=0.1,
                                              msa_indexer_loss_type="sparse",
                                              msa_log_selection_recall=True))
    deterministic_init([model])
    layers = _attention_layers(model)
    assert registry_calls["resolve"] == len(layers), registry_calls  # one plan per layer
    assert all(layer.msa_plan.backend.name == "reference" for layer in layers)
    assert [layer.msa_plan.loss_route for layer in layers] == ["byproducts"] * len(layers)
    assert {layer.msa_plan.kernels for layer in layers} == {MSAKernels(
        forward="reference", mass_forward="reference", dkdv="reference")}
    registry_calls.update(load=0, resolve=0)
    unplanned.reset()
    with OpCounter() as ops:
        _training_step(model)
    assert registry_calls == {"load": 0, "resolve": 0}, (
        f"a training step looked the backend up: {registry_calls}")
    assert unplanned.counts() == {}, f"choices made outside the plan: {unplanned.counts()}"
    assert not ops.triton_launches(), dict(ops.triton_launches())


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
    unplanned.reset()
    _training_step(model)
    assert not range_checks, f"a training step checked config ranges: {dict(range_checks)}"
    assert unplanned.counts() == {}, f"choices made outside the plan: {unplanned.counts()}"


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


def _triton_launches_of_a_layer_step(config) -> tuple[collections.Counter, MSAKernels]:
    """The Triton kernels one forward + backward of an MSA layer launches (bf16, the sparse
    indexer loss from by-products with the sampled recall, q/k norms, RoPE), by kernel name,
    and the kernels its plan names; the step makes no choice outside the plan."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    torch.manual_seed(0)
    layer = _build_attention(config).to(torch.bfloat16).train()
    unplanned.reset()
    # One row of three packed documents and padding (the interpreter's cost grows with it).
    hidden = torch.randn(SEQ, 1, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    ids = packed_batches(1)[0]["packed_seq_ids"][:1]
    rotary = RotaryEmbedding(config.kv_channels, rotary_percent=0.5, rotary_base=5_000_000)(SEQ)
    with OpCounter() as ops:
        out, _ = layer(hidden, ids, rotary_pos_emb=rotary)
        out.float().square().sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad.float()).all()
    assert unplanned.counts() == {}, f"choices made outside the plan: {unplanned.counts()}"
    return ops.triton_launches(), layer.msa_plan.kernels


#: Two query heads sharing one KV head (still grouped-query attention): which kernels the plan
#: names and the step launches does not depend on the head count, and the interpreter's time
#: grows with it (4 heads over 2 groups took twice as long).
_LAYER_STEP = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                   qk_layernorm=True, msa_indexer_loss_coeff=0.1, msa_indexer_loss_type="sparse",
                   msa_log_selection_recall=True, num_attention_heads=2, num_query_groups=1)


def test_the_reference_backend_runs_no_triton_kernel_in_a_layer_step():
    """msa_backend="reference" means plain PyTorch everywhere in the layer: its plan turns the
    fused helpers off (norms, RoPE, the by-product loss's passes, the recall, the dense path),
    so a bf16 training step launches no Triton kernel, even under the interpreter, where every
    helper deciding from the device alone would launch its kernel."""
    launches, kernels = _triton_launches_of_a_layer_step(tiny_config(msa_backend="reference",
                                                                     **_LAYER_STEP))
    assert kernels == MSAKernels(forward="reference", mass_forward="reference",
                                 dkdv="reference")
    assert not launches, f"the reference backend launched Triton kernels: {dict(launches)}"


def test_the_triton_backend_runs_the_kernels_its_plan_names_in_a_layer_step(
        kernel_backends_on_the_cpu):
    """The same step on the Triton backend (its device check doubled on the CPU; the
    interpreter runs the kernels) makes no choice outside the plan either, and launches the
    kernels the plan names: the helpers' as well as the ops', and the dk/dv kernel it names
    (the Triton one: the CPU is no SM90 GPU)."""
    launches, kernels = _triton_launches_of_a_layer_step(tiny_config(msa_backend="triton",
                                                                     **_LAYER_STEP))
    assert kernels == MSAKernels(forward="triton", mass_forward="triton", dkdv="triton",
                                 rms_norm=True, rope=True, loss_passes=True, recall=True,
                                 dense_attention="rows")
    named = {"_rms_fwd_kernel", "_rms_bwd_kernel", "_rope_kernel", "_block_scores_kernel",
             "_sparse_kl_fwd_kernel", "_recall_kernel", "_fwd_kernel", "_dq_kernel",
             "_dkdv_kernel"}
    assert named <= set(launches), dict(launches)
    assert not any("sm90" in name for name in launches), dict(launches)  # no Gluon dk/dv


def test_the_layers_norms_and_rope_get_their_kernel_from_the_plan():
    """The q/k and index norms are built with the plan's ``rms_norm`` (no write after
    construction); a norm or RoPE the plan named its kernel for refuses an input the kernel
    does not take, naming the field; RoPE without a plan chooses per call, counted."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from nemo_msa.megatron.norms import RMSNorm, planned_norm
    from nemo_msa.megatron.rope import apply_rope, rope_factors

    spec = planned_norm(RMSNorm, True)
    assert isinstance(spec, ModuleSpec) and spec.params == {"fused": True}
    assert planned_norm(torch.nn.LayerNorm, True) is torch.nn.LayerNorm  # not ours: as it is
    layer = _build_attention(tiny_config(msa_backend="reference", qk_layernorm=True))
    norms = [m for m in layer.modules() if isinstance(m, RMSNorm)]
    assert len(norms) >= 2 and not any(m.fused for m in norms)  # the reference plan's
    config = tiny_config()
    norm = RMSNorm(config, 32, fused=True)
    with pytest.raises(ValueError, match=r"MSAKernels.rms_norm=True but .*dtype torch.float32"):
        norm(torch.randn(4, 32))
    freqs = torch.randn(4, 1, 16)
    with pytest.raises(ValueError, match=r"MSAKernels.rope=True but"):
        apply_rope(torch.randn(4, 2, 32), rope_factors(freqs, config, fused=True,
                                                        te_fused=False), config)
    unplanned.reset()
    # A direct caller without the plan's fields decides both RoPE kernels itself.
    apply_rope(torch.randn(4, 2, 32), rope_factors(freqs, config), config)
    assert unplanned.counts() == {"rope": 1, "te_rope": 1}
