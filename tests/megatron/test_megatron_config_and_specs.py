"""MSATransformerConfig validation, the construction gate, specs, name mapping and the
per-microbatch data cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _megatron_harness import tiny_config

from layer_specs import (
    get_msa_decoder_block_spec,
    get_msa_layer_spec,
    get_msa_self_attention_spec,
    te_unavailable_reason,
)
from nemo_msa import MSAMicrobatch
from nemo_msa.megatron import (
    MSASelfAttention,
    MSATransformerConfig,
    SharedMicrobatchIterators,
    normalize_layer_pattern,
)
from nemo_msa.megatron.checkpoint_mapping import (
    hf_to_megatron_name,
    indexer_state_dict_from_hf,
    indexer_state_dict_to_hf,
    megatron_to_hf_name,
)

PRODUCTION = dict(
    num_layers=4,
    hidden_size=1024,
    num_attention_heads=64,
    num_query_groups=4,
    kv_channels=128,
    ffn_hidden_size=2048,
    attention_dropout=0.0,
    transformer_impl="local",
    use_cpu_initialization=True,
)


# ---------------------------------------------------------------------- config
def test_production_topology_defaults():
    config = MSATransformerConfig(**PRODUCTION)
    assert (config.msa_num_index_heads, config.msa_index_head_dim) == (4, 128)
    assert (config.msa_block_size, config.msa_topk) == (128, 16)
    assert (config.msa_init_blocks, config.msa_local_blocks, config.msa_score_type) == (0, 1, "max")
    assert config.msa_layer_flags == (True,) * 4
    assert config.hetereogenous_dist_checkpoint is False
    from nemo_msa.megatron import MSAIndexerLossAutoScaler

    assert config.experimental_attention_variant_loss_scale_func == (
        MSAIndexerLossAutoScaler.set_loss_scale
    )


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("msa_score_type", "mean", "msa_score_type='mean'"),
        ("msa_num_index_heads", 2, "msa_num_index_heads=2"),
        ("msa_topk", 0, "msa_topk=0"),
        ("msa_topk", 33, "msa_topk=33"),
        ("msa_block_size", 100, "msa_block_size=100"),
        ("msa_index_head_dim", 96, "msa_index_head_dim=96"),
        ("msa_init_blocks", -1, "msa_init_blocks=-1"),
        ("msa_local_blocks", 17, r"msa_init_blocks \+ msa_local_blocks=17"),
        ("msa_indexer_loss_coeff", -0.5, "msa_indexer_loss_coeff=-0.5"),
        ("msa_dense_warmup_steps", -2, "msa_dense_warmup_steps=-2"),
        ("msa_layer_pattern", "SSD", "describes 3 layers; expected num_layers=4"),
        ("msa_layer_pattern", "SSXD", "characters \\['X'\\]"),
        ("msa_layer_pattern", [1, 2, 1, 1], "0/1 per layer"),
    ],
)
def test_config_rejects_bad_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        MSATransformerConfig(**{**PRODUCTION, field: value})


@pytest.mark.usefixtures("single_rank")
def test_the_layer_refuses_tensor_parallelism_that_splits_a_kv_head():
    """Checked once, when the layer is built, against its tensor-parallel group's size."""
    from nemo_msa.megatron.msa_attention import check_msa_layer_config

    config = tiny_config()
    assert check_msa_layer_config(config, tp_size=2, cp_size=1).backend
    for tp in (4, 3):
        with pytest.raises(ValueError, match=f"tensor parallel size {tp} with num_query_groups=2"):
            check_msa_layer_config(config, tp_size=tp, cp_size=1)


@pytest.mark.usefixtures("single_rank")
def test_deterministic_mode_needs_torchs_switch_and_drops_cudnn_attention():
    """deterministic_mode is a config field; the deterministic CUDA forms of the layer's torch
    ops (flash SDPA's backward, index_add_) come only with torch's global switch (ADR 0050)."""
    from nemo_msa.attention.dense import (
        DETERMINISTIC_SDPA_BACKENDS,
        GPU_SDPA_BACKENDS,
        gpu_sdpa_backends,
    )
    from nemo_msa.megatron.msa_attention import check_msa_layer_config

    config = tiny_config(deterministic_mode=True)
    refusal = r"deterministic_mode=True needs torch.use_deterministic_algorithms\(True\) \(not " \
              r"warn_only\) before the layer is built"
    with pytest.raises(ValueError, match=refusal):
        check_msa_layer_config(config, tp_size=1, cp_size=1)
    assert gpu_sdpa_backends() == GPU_SDPA_BACKENDS
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.raises(ValueError, match=refusal):
            check_msa_layer_config(config, tp_size=1, cp_size=1)
        torch.use_deterministic_algorithms(True)
        assert check_msa_layer_config(config, tp_size=1, cp_size=1).backend
        # cuDNN's SDPA backward has no deterministic form: flash, then memory-efficient.
        assert gpu_sdpa_backends() == DETERMINISTIC_SDPA_BACKENDS
        assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in gpu_sdpa_backends()
    finally:
        torch.use_deterministic_algorithms(False)
    assert gpu_sdpa_backends() == GPU_SDPA_BACKENDS


def test_layer_pattern_forms():
    assert normalize_layer_pattern("DS|S S", 4) == (False, True, True, True)
    assert normalize_layer_pattern([0, 1, 1, 0], 4) == (False, True, True, False)
    config = MSATransformerConfig(**{**PRODUCTION, "msa_layer_pattern": "DSSS"})
    assert [config.is_msa_layer(n) for n in (1, 2, 3, 4)] == [False, True, True, True]
    assert config.hetereogenous_dist_checkpoint is True
    with pytest.raises(ValueError, match="layer_number=5"):
        config.is_msa_layer(5)


# ---------------------------------------------------------------------- specs
def test_specs_follow_the_pattern_and_share_objects():
    config = tiny_config(msa_layer_pattern="SDSS")
    specs = get_msa_decoder_block_spec(config, vp_stage=None, pp_rank=0).layer_specs
    assert len(specs) == 4
    indexers = [s.submodules.self_attention.submodules.indexer for s in specs]
    assert [i is not None for i in indexers] == [True, False, True, True]
    assert specs[0] is specs[2] is specs[3] and specs[1] is not specs[0]
    attention = specs[0].submodules.self_attention
    assert attention.module is MSASelfAttention
    names = dataclasses.asdict(attention.submodules.indexer.submodules)
    assert set(names) == {"index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm"}


def test_sequence_parallel_with_local_norms_is_refused_with_the_reason():
    config = tiny_config()
    config.sequence_parallel = True  # set after validation, as a launcher might
    with pytest.raises(ValueError, match="sequence_parallel=True with transformer_impl='local'"):
        get_msa_layer_spec(config)


def test_transformer_engine_spec_without_te_names_the_reason():
    """Where TE does not import, asking for its spec is one ImportError saying what to set; the
    TE spec itself is tested on the GPU (tests/megatron/test_te_spec.py)."""
    reason = te_unavailable_reason()
    if reason is None:
        pytest.skip("Transformer Engine imports here: test_te_spec.py covers its spec")
    with pytest.raises(ImportError, match="needs Transformer Engine.*transformer_impl='local'"):
        get_msa_self_attention_spec(tiny_config(), transformer_impl="transformer_engine")


# ---------------------------------------------------------------------- construction gate
def _build_attention(config, sparse=True):
    from megatron.core.transformer.spec_utils import build_module

    spec = get_msa_self_attention_spec(config, sparse=sparse, transformer_impl="local")
    return build_module(spec, config=config, layer_number=1)


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        # tiny_config builds the local spec, whose linears would ignore fp8 (ADR 0036).
        ("fp8", "e4m3", ValueError,
         "config.fp8='e4m3': expected null/None with transformer_impl='local'"),
        ("fp4", "nvfp4", NotImplementedError, "FP4"),
        ("fused_single_qkv_rope", True, NotImplementedError,
         "fused_single_qkv_rope=True: Transformer Engine's fused QKV RoPE .* no cu_seqlens"),
        ("msa_score_type", "mean", ValueError, "msa_score_type='mean'"),
        ("msa_block_size", 48, ValueError, "msa_block_size=48"),
        ("msa_num_index_heads", 1, ValueError, "msa_num_index_heads=1"),
        ("attention_dropout", 0.1, ValueError, "attention_dropout=0.1"),
        ("multi_latent_attention", True, NotImplementedError, "multi_latent_attention"),
        ("cuda_graph_impl", "local", NotImplementedError, "cuda_graph_impl='local'"),
        ("window_size", (64, 0), NotImplementedError, "sliding windows"),
    ],
)
def test_construction_gate(field, value, error, match):
    config = tiny_config()
    setattr(config, field, value)  # bypasses __post_init__: the layer must still refuse
    with pytest.raises(error, match=match):
        _build_attention(config)


@pytest.mark.usefixtures("single_rank")
def test_context_parallelism_needs_a_backend_with_the_query_subset_mode(monkeypatch):
    """Under CP the layer's plan asks the backend's record for the query subset when the layer
    is built: a backend without it (a GPU-less double of the Triton backend with the mode off)
    is refused naming context_parallel_size; the reference builds."""
    from nemo_msa.backends import registry as backends

    triton = backends.get_backend("triton")
    monkeypatch.setitem(backends._REGISTRY, "triton", dataclasses.replace(
        triton, unavailable_reason=lambda device: None,
        capabilities=dataclasses.replace(triton.capabilities, query_subset=False)))
    config = tiny_config(msa_backend="triton", bf16=True)
    config.context_parallel_size = 2  # bypasses __post_init__
    with pytest.raises(ValueError, match="context_parallel_size=2: the Triton kernels take no "
                                         "query subset"):
        _build_attention(config)
    config = tiny_config(msa_backend="reference")
    config.context_parallel_size = 2
    _build_attention(config)


@pytest.mark.usefixtures("single_rank")
def test_the_layer_gate_asks_the_triton_backend_for_lse(monkeypatch):
    """msa_score_type='lse' with msa_backend='triton' is refused when the layer is built (not
    at its first step), naming the field; the backend's device check is a GPU-less double."""
    from nemo_msa.backends import registry as backends

    triton = backends.get_backend("triton")
    monkeypatch.setitem(backends._REGISTRY, "triton",
                        dataclasses.replace(triton, unavailable_reason=lambda device: None))
    config = tiny_config(msa_backend="triton", msa_score_type="lse", bf16=True)
    with pytest.raises(ValueError, match="msa_score_type='lse': the Triton kernels take one of"):
        _build_attention(config)
    _build_attention(tiny_config(msa_backend="auto", msa_score_type="lse"))  # reference runs


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "dense_document"])
def test_fused_rope_needs_transformer_engine_and_cuda(monkeypatch, sparse):
    """ADR 0054: apply_rope_fusion=True runs TE's fused RoPE; where TE's fused RoPE does not
    import the layer is refused when built, in one line naming the field; with TE, a layer that
    would run on the CPU is refused too (TE's RoPE is a CUDA kernel)."""
    from nemo_msa.megatron import rope

    config = tiny_config()
    config.apply_rope_fusion = True  # bypasses __post_init__ (Megatron's own TE check)
    monkeypatch.setattr(rope, "fused_apply_rotary_pos_emb", None)
    with pytest.raises(ImportError, match=r"^config.apply_rope_fusion=True needs Transformer "
                                          r"Engine's fused RoPE .* set apply_rope_fusion=False"):
        _build_attention(config, sparse=sparse)
    monkeypatch.setattr(rope, "fused_apply_rotary_pos_emb", lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match=r"apply_rope_fusion=True on device 'cpu'"):
        _build_attention(config, sparse=sparse)
    config.apply_rope_fusion = False
    _build_attention(config, sparse=sparse)


def test_fused_rope_without_transformer_engine_fails_at_the_config():
    """Without TE, Megatron's own config check refuses apply_rope_fusion=True when the config
    is made, before any layer."""
    from megatron.core.models.common.embeddings.rope_utils import fused_apply_rotary_pos_emb

    if fused_apply_rotary_pos_emb is not None:
        pytest.skip("Transformer Engine imports here: Megatron's config accepts the flag")
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        tiny_config(apply_rope_fusion=True)


@pytest.mark.usefixtures("single_rank")
def test_gate_applies_to_dense_layers_and_plain_configs():
    config = tiny_config()
    config.fused_single_qkv_rope = True
    with pytest.raises(NotImplementedError, match="fused_single_qkv_rope"):
        _build_attention(config, sparse=False)
    from megatron.core.transformer.transformer_config import TransformerConfig

    plain = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True
    )
    with pytest.raises(ValueError, match="without the msa_\\* fields"):
        _build_attention(plain)


@pytest.mark.usefixtures("single_rank")
def test_runtime_rejections():
    attention = _build_attention(tiny_config())
    hidden = torch.randn(32, 2, 64)
    with pytest.raises(NotImplementedError, match="qkv_format=None.*THD"):
        attention(hidden, None, packed_seq_params=object())
    with pytest.raises(NotImplementedError, match="cross-attention"):
        attention(hidden, None, key_value_states=hidden)
    with pytest.raises(ValueError, match=r"shape \(2, 31\)"):
        attention(hidden, torch.ones(2, 31, dtype=torch.long))
    megatron_causal = torch.triu(torch.ones(2, 1, 32, 32, dtype=torch.bool), diagonal=1)
    with pytest.raises(ValueError, match="True = masked out; pass the loader's packed_seq_ids"):
        attention(hidden, megatron_causal)


@pytest.mark.usefixtures("single_rank")
def test_thd_input_refusals_name_the_argument():
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = _build_attention(tiny_config())
    cu = torch.tensor([0, 20, 32], dtype=torch.int32)

    def params(**changes):
        fields = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=20,
                      max_seqlen_kv=20)
        fields.update(changes)
        return PackedSeqParams(**fields)

    hidden = torch.randn(32, 1, 64)
    out, _ = attention(hidden, None, packed_seq_params=params())
    assert out.shape == hidden.shape and torch.isfinite(out).all()
    with pytest.raises(NotImplementedError, match="qkv_format='sbhd'"):
        attention(hidden, None, packed_seq_params=params(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="attention_mask and packed_seq_params were both given"):
        attention(hidden, torch.ones(1, 32, dtype=torch.long), packed_seq_params=params())
    with pytest.raises(NotImplementedError, match="cu_seqlens_kv differs from cu_seqlens_q"):
        attention(hidden, None, packed_seq_params=params(
            cu_seqlens_kv=torch.tensor([0, 16, 32], dtype=torch.int32)))
    with pytest.raises(ValueError, match="describe 32 tokens .* the activations hold 30"):
        attention(torch.randn(30, 1, 64), None, packed_seq_params=params())
    with pytest.raises(ValueError, match="THD activations must be \\[tokens, 1, hidden\\]"):
        attention(torch.randn(32, 2, 64), None, packed_seq_params=params())


# ---------------------------------------------------------------------- checkpoint names
def test_minimax_m3_name_mapping_round_trip():
    names = [
        f"decoder.layers.3.self_attention.indexer.{p}.weight"
        for p in ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")
    ]
    public = [megatron_to_hf_name(n) for n in names]
    assert public == [
        "model.layers.3.self_attn.index_q_proj.weight",
        "model.layers.3.self_attn.index_k_proj.weight",
        "model.layers.3.self_attn.index_q_norm.weight",
        "model.layers.3.self_attn.index_k_norm.weight",
    ]
    assert [hf_to_megatron_name(n) for n in public] == names
    assert megatron_to_hf_name("decoder.layers.3.self_attention.linear_qkv.weight") is None
    state = {n: torch.randn(8, 4) if "proj" in n else torch.randn(4) for n in names}
    back = indexer_state_dict_from_hf(indexer_state_dict_to_hf(state))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    bad = {"model.layers.0.self_attn.index_q_proj.weight": torch.zeros(5, 4)}
    with pytest.raises(ValueError, match=r"index_q_proj.weight has shape \(5, 4\)"):
        indexer_state_dict_from_hf(bad, num_index_heads=2, index_head_dim=4)


# ---------------------------------------------------------------------- data-side cache
def test_shared_microbatch_iterators_hand_the_same_objects_to_every_chunk():
    batches = [{"ids": torch.full((2, 8), i + 1)} for i in range(3)]
    shared = SharedMicrobatchIterators(iter(batches), num_chunks=2, device="cpu")
    first, second = shared.iterators()
    a0, a1 = next(first), next(first)
    b0 = next(second)
    assert a0["ids"] is b0["ids"] and a0["ids"] is batches[0]["ids"]
    assert shared.num_fetched == 2 and len(shared._buffer) == 1  # microbatch 0 released
    b1, b2, a2 = next(second), next(second), next(first)
    assert b1 is a1 and b2 is a2 and shared.num_fetched == 3
    assert next(first, None) is None and next(second, None) is None
    with pytest.raises(ValueError, match="num_chunks=0"):
        SharedMicrobatchIterators(iter([]), num_chunks=0)
    # One layout per shared tensor, whichever chunk asks.
    builds = MSAMicrobatch.num_builds()
    for batch in (a0, b0, a1, b1):
        MSAMicrobatch.build(attention_mask=batch["ids"], block_size=16)
    assert MSAMicrobatch.num_builds() - builds == 2
