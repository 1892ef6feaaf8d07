"""The construction gate, the runtime rejections and the backend registry."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from nemo_msa import (
    MSAMicrobatch,
    check_runtime_arguments,
    register_backend,
    require_msa_support,
    resolve_backend,
    select_blocks,
)
from nemo_msa.backends import registry as backends
from nemo_msa.backends.registry import ENV_VAR, MSABackend, get_backend, known_backends
from nemo_msa.plan import MSAPlan


def production_config(**changes):
    fields = dict(
        num_attention_heads=64, num_query_groups=4, kv_channels=128, hidden_size=6144,
        msa_num_index_heads=4, msa_index_head_dim=128, msa_block_size=128, msa_topk=16,
        msa_init_blocks=0, msa_local_blocks=1, msa_score_type="max", fp8=None, fp4=None,
        apply_rope_fusion=False, fused_single_qkv_rope=False, context_parallel_size=1,
    )
    fields.update(changes)
    return SimpleNamespace(**fields)


def test_production_topology_passes_the_gate():
    topology = require_msa_support(production_config(), backend="reference")
    assert (topology.num_heads, topology.num_kv_heads, topology.head_dim) == (64, 4, 128)
    assert (topology.block_size, topology.top_k, topology.local_blocks) == (128, 16, 1)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"fp8": "hybrid", "fp8_dot_product_attention": True}, "fp8_dot_product_attention"),
        ({"fp8": "e4m3", "fp8_multi_head_attention": True}, "fp8_multi_head_attention"),
        ({"fp4": "nvfp4"}, "FP4"),
        ({"fused_single_qkv_rope": True}, "fused_single_qkv_rope=True: .* one start position "
                                          "per row and no cu_seqlens"),
    ],
)
def test_unsupported_features_raise_not_implemented(changes, match):
    with pytest.raises(NotImplementedError, match=match):
        require_msa_support(production_config(**changes))


def test_fused_rope_is_the_megatron_layers_gate():
    """apply_rope_fusion runs TE's fused RoPE at document positions (ADR 0054); its gate needs TE
    and the layer's device, so the Megatron layer checks it (nemo_msa.megatron.rope), not the
    core."""
    assert require_msa_support(production_config(apply_rope_fusion=True)).top_k == 16


def test_fp8_gemms_pass_the_gate_with_transformer_engine_layers_only():
    """FP8 GEMMs around bf16 attention are supported with TE's linears (ADR 0036); with the local
    linears fp8 would be ignored, so it is refused naming transformer_impl."""
    for impl in ("transformer_engine", None):  # None: Megatron's default, TE
        fields = {"fp8": "hybrid"} if impl is None else {"fp8": "hybrid", "transformer_impl": impl}
        assert require_msa_support(production_config(**fields)).head_dim == 128
    with pytest.raises(ValueError, match=r"config.fp8='hybrid': expected null/None with "
                                         r"transformer_impl='local'"):
        require_msa_support(production_config(fp8="hybrid", transformer_impl="local"))
    # Without fp8 the FP8-attention flags are inert, as in Megatron.
    require_msa_support(production_config(fp8_dot_product_attention=True))


def test_context_parallelism_is_a_capability_of_the_backend(kernel_backends_on_the_cpu):
    """CP > 1 (the layer's process group or the config) needs a backend whose capability record
    declares the query subset: one named without it is refused when the plan is built, naming
    context_parallel_size; ``auto`` skips it (the reference takes every query subset)."""

    for name in ("triton", "flashinfer"):
        backend = backends.get_backend(name)
        backends.register_backend(dataclasses.replace(
            backend, capabilities=dataclasses.replace(backend.capabilities, query_subset=False)))
    with pytest.raises(ValueError, match="context_parallel_size=2: the Triton kernels take no"):
        MSAPlan.build(production_config(), "cpu", torch.bfloat16, cp_size=2, backend="triton")
    with pytest.raises(ValueError, match="context_parallel_size=4"):
        MSAPlan.build(production_config(context_parallel_size=4), "cpu", torch.bfloat16,
                      backend="triton")
    plan = MSAPlan.build(production_config(), "cpu", torch.bfloat16, cp_size=2, backend="auto")
    assert (plan.backend.name, plan.cp_size) == ("reference", 2)
    assert not plan.fused_dense_loss  # the reference has no fused loss
    assert MSAPlan.build(production_config(), "cpu", torch.bfloat16,
                         backend="auto").backend.name != "reference"  # CP = 1


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"msa_score_type": "mean"}, "msa_score_type='mean'"),
        ({"msa_num_index_heads": 8}, "msa_num_index_heads=8"),
        ({"num_query_groups": 5}, "num_query_groups=5"),
        ({"kv_channels": 96}, "kv_channels=96"),
        ({"msa_block_size": 100}, "msa_block_size=100"),
        ({"msa_topk": 33}, "msa_topk=33"),
        ({"msa_init_blocks": 10, "msa_local_blocks": 7}, "msa_init_blocks \\+ msa_local_blocks=17"),
        ({"msa_index_head_dim": 48}, "msa_index_head_dim=48"),
    ],
)
def test_unsupported_topology_raises_value_error_naming_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        require_msa_support(production_config(**changes))


def test_unknown_backend_is_refused_at_construction():
    with pytest.raises(ValueError, match="'cutlass' is not available"):
        require_msa_support(production_config(), backend="cutlass")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"inference_context": object()}, "KV-cache"),
        ({"key_value_states": torch.zeros(1)}, "cross-attention"),
        ({"window_size": (128, 0)}, "sliding windows"),
        ({"attn_mask_type": SimpleNamespace(name="no_mask")}, "no_mask"),
        ({"rotary_pos_cos_sin": (torch.zeros(1), torch.zeros(1))}, "rotary_pos_cos_sin"),
    ],
)
def test_runtime_rejections(kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        check_runtime_arguments(**kwargs)


def test_runtime_accepts_what_msa_supports():
    check_runtime_arguments(attn_mask_type=SimpleNamespace(name="causal"), window_size=None)


def test_auto_picks_the_reference_on_cpu_and_env_var_overrides(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend(None, "cpu").name == "reference"
    assert resolve_backend("auto", "cpu").name == "reference"
    assert "reference" in known_backends() and "triton" in known_backends()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cannot run on cpu"):
            resolve_backend("triton", "cpu")
    monkeypatch.setenv(ENV_VAR, "nonexistent")
    with pytest.raises(ValueError, match="NEMO_MSA_BACKEND=nonexistent: MSA backend "
                                         "'nonexistent' is not available"):
        resolve_backend("reference", "cpu")


def test_a_registered_backend_is_dispatched_to(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    # A private copy of the registry, so the test double does not outlive the test.
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    calls = []
    reference = get_backend("reference")

    def counting_select(*args, **kwargs):
        calls.append("select")
        return reference.select_blocks(*args, **kwargs)

    register_backend(MSABackend(
        name="counting", select_blocks=counting_select,
        attention_forward=reference.attention_forward,
        attention_backward=reference.attention_backward,
        unavailable_reason=lambda device: None if device.type == "cpu" else "cpu only",
        capabilities=reference.capabilities, description="test double",
    ))
    msa = MSAMicrobatch.build(batch_size=1, seq_len=40, block_size=16)
    got = select_blocks(torch.randn(40, 1, 8), torch.randn(40, 8), msa, top_k=2,
                        backend="counting")
    assert calls == ["select"] and got.shape == (1, 40, 2)
    monkeypatch.setenv(ENV_VAR, "reference")
    select_blocks(torch.randn(40, 1, 8), torch.randn(40, 8), msa, top_k=2, backend="counting")
    assert calls == ["select"], "the environment variable must override the requested backend"


def test_a_backends_forward_state_reaches_its_backward_on_the_selection(monkeypatch):
    """A backend's forward keeps state of the selection for its backward on the
    :class:`~nemo_msa.q2k.Selection` the ops hand it (the Triton union lists): autograd hands
    the backward that same object, and the gradients are the wrapped reference's."""
    from nemo_msa import select, sparse_attention

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    reference = get_backend("reference")
    handed = []

    def forward(q, k, v, selection, view, scale, **kwargs):
        selection.unions = ("state", selection.q2k.data_ptr())
        return reference.attention_forward(q, k, v, selection, view, scale, **kwargs)

    def backward(*args, **kwargs):
        handed.append(args[6].unions)
        return reference.attention_backward(*args, **kwargs)

    register_backend(MSABackend(
        name="stateful", select_blocks=reference.select_blocks, attention_forward=forward,
        attention_backward=backward, unavailable_reason=lambda device: None,
        capabilities=reference.capabilities, description="test double",
    ))
    g = torch.Generator().manual_seed(3)
    msa = MSAMicrobatch.build(batch_size=1, seq_len=40, block_size=16)
    q = torch.randn(40, 2, 16, generator=g).bfloat16()
    k, v = (torch.randn(40, 1, 16, generator=g).bfloat16() for _ in range(2))
    selection = select(torch.randn(40, 1, 8, generator=g), torch.randn(40, 8, generator=g),
                       msa, top_k=2, backend="reference")
    dout = torch.randn(40, 2, 16, generator=g).bfloat16()
    grads = {}
    for name in ("stateful", "reference"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = sparse_attention(*xs, selection, msa, backend=name)
        grads[name] = (out, *torch.autograd.grad(out, xs, dout))
    assert handed == [("state", selection.q2k.data_ptr())]
    assert all(torch.equal(a, b) for a, b in zip(grads["stateful"], grads["reference"],
                                                 strict=True))
    selection.q2k[0, 0, 0] = 0  # an in-place write: what the selection claims no longer holds
    with pytest.raises(ValueError, match="written in place"):
        sparse_attention(q, k, v, selection, msa, backend="reference")


@pytest.fixture
def triton_runs_on_the_cpu(monkeypatch):
    """A GPU-less double of the Triton backend's device check: it 'runs' on the CPU, so the
    gate's shape check is what decides (the kernels themselves are never launched here)."""
    import dataclasses


    triton = backends.get_backend("triton")
    monkeypatch.setitem(backends._REGISTRY, "triton",
                        dataclasses.replace(triton, unavailable_reason=lambda device: None))


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(msa_score_type="lse"), "msa_score_type='lse'"),
        (dict(kv_channels=256), "kv_channels=256"),
        (dict(msa_index_head_dim=256), "msa_index_head_dim=256"),
        (dict(msa_block_size=256), "msa_block_size=256"),
    ],
)
def test_the_gate_asks_the_backend_that_will_run(triton_runs_on_the_cpu, changes, field):
    """A topology the contract allows but the Triton kernels do not take is refused when the
    layer is built, naming the field, where Triton is the backend that will run; auto picks a
    backend that can run it instead."""
    config = production_config(**changes)
    with pytest.raises(ValueError, match=re.escape(field)):
        MSAPlan.build(config, "cpu", torch.bfloat16, backend="triton")
    assert MSAPlan.build(config, "cpu", torch.bfloat16, backend="auto").backend.name == (
        "reference")
    assert resolve_backend(
        "auto", "cpu", score_type=config.msa_score_type, head_dim=config.kv_channels,
        index_head_dim=config.msa_index_head_dim, block_size=config.msa_block_size,
    ).name == "reference"


def test_the_gate_refuses_triton_for_fp32_parameters(triton_runs_on_the_cpu):
    MSAPlan.build(production_config(), "cpu", torch.bfloat16, backend="triton")
    with pytest.raises(ValueError, match="params dtype torch.float32"):
        MSAPlan.build(production_config(), "cpu", torch.float32, backend="triton")
    assert resolve_backend("auto", "cpu", dtype=torch.bfloat16).name == "triton"


@pytest.mark.gpu
def test_on_the_gpu_the_gate_refuses_lse_and_head_dim_256_for_triton():
    for changes, field in ((dict(msa_score_type="lse"), "msa_score_type"),
                           (dict(kv_channels=256), "kv_channels=256")):
        with pytest.raises(ValueError, match=field):
            MSAPlan.build(production_config(**changes), "cuda", torch.bfloat16,
                          backend="triton")
    assert MSAPlan.build(production_config(), "cuda", torch.bfloat16,
                         backend="triton").backend.name == "triton"
