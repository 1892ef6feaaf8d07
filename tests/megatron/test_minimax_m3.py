"""The MiniMax-M3 block: SwiGLU-OAI and zero-centred RMSNorm against their formulas, the layer
specs of the M3 recipes (MoE/dense MLP per layer, every norm following the config, TE where
installed), and the Hugging Face <-> Megatron converter (bitwise round trip, MTP module included;
the converted model, its MTP module included, computes what a forward written from M3's names
computes, float64)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _m3_reference import ToyM3, hf_forward, hf_mtp_forward, swiglu_oai, synthetic_checkpoint

from nemo_msa.megatron import MSATransformerConfig, cpu_shim
from nemo_msa.megatron.hf_convert import hf_to_megatron, megatron_to_hf
from nemo_msa.megatron.norms import RMSNorm
from nemo_msa.training.recipe import RECIPES_DIR, load_recipe


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _recipe_config(name: str, overrides: list[str] | None = None):
    from nemo_msa.training.build import build_config
    from nemo_msa.training.setup import RunContext

    recipe = load_recipe(RECIPES_DIR / name, overrides or [])
    return build_config(recipe, RunContext(0, 1, torch.device("cpu"), True, False)), recipe


def _toy_config(toy: ToyM3, **overrides) -> MSATransformerConfig:
    from megatron.core.activations import quick_gelu

    fields = dict(
        num_layers=len(toy.moe_layers), hidden_size=toy.hidden, ffn_hidden_size=toy.dense_ffn,
        num_attention_heads=toy.heads, num_query_groups=toy.kv_heads, kv_channels=toy.head_dim,
        normalization="RMSNorm", layernorm_zero_centered_gamma=True, layernorm_epsilon=toy.eps,
        qk_layernorm=True, gated_linear_unit=True, activation_func=quick_gelu,
        activation_func_clamp_value=toy.limit, glu_linear_offset=1.0, add_bias_linear=False,
        num_moe_experts=toy.experts, moe_layer_freq=list(toy.moe_layers),
        moe_ffn_hidden_size=toy.expert_ffn, moe_shared_expert_intermediate_size=toy.shared_ffn,
        moe_router_topk=toy.topk, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=toy.scaling,
        moe_router_dtype="fp64", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", transformer_impl="local", attention_dropout=0.0,
        hidden_dropout=0.0, params_dtype=torch.float64, pipeline_dtype=torch.float64,
        msa_layer_pattern=list(toy.msa_layers), msa_num_index_heads=toy.index_heads,
        msa_index_head_dim=toy.index_dim, msa_block_size=toy.block, msa_topk=toy.msa_topk,
        msa_backend="reference", msa_indexer_loss_coeff=0.0, **cpu_shim.cpu_config_overrides())
    fields.update(overrides)
    return MSATransformerConfig(**fields)


def _gpt(config, vocab: int):
    from megatron.core.models.gpt import GPTModel

    from nemo_msa.megatron.layer_specs import get_msa_decoder_block_spec, get_msa_mtp_block_spec

    return GPTModel(config, get_msa_decoder_block_spec(config), vocab_size=vocab,
                    max_sequence_length=256, position_embedding_type="rope",
                    rotary_percent=0.5, rotary_base=5_000_000,
                    share_embeddings_and_output_weights=False,
                    mtp_block_spec=get_msa_mtp_block_spec(config))


# ------------------------------------------------------------------ formulas
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_matches_its_formula_in_float64(single_rank, zero_centered):
    config = _toy_config(ToyM3(), layernorm_zero_centered_gamma=zero_centered)
    norm = RMSNorm(config, hidden_size=24, eps=1e-6)
    assert float(norm.weight.abs().sum()) == (0.0 if zero_centered else 24.0)  # identity at init
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g, dtype=torch.float64))
    x = torch.randn(5, 3, 24, generator=g, dtype=torch.float64) * 4
    scale = (1.0 + norm.weight) if zero_centered else norm.weight
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    got = norm(x)
    assert got.dtype == torch.float64
    assert _rel(got.detach(), want.detach()) < 1e-14


def test_swiglu_oai_as_the_tiny_recipe_configures_megatron(single_rank):
    """Megatron's MLP with the recipe's quick_gelu, activation_func_clamp_value=7 and
    glu_linear_offset=1 computes down(quick_gelu(min(gate, 7)) * (clamp(up, -7, 7) + 1))."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    config, _ = _recipe_config("minimax_m3_tiny.yaml")
    assert (config.activation_func_clamp_value, config.glu_linear_offset) == (7.0, 1.0)
    config = dataclasses.replace(config, params_dtype=torch.float64)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                    linear_fc2=RowParallelLinear))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, config.hidden_size, generator=g, dtype=torch.float64) * 3
    with torch.no_grad():
        mlp.linear_fc1.weight.normal_(0.0, 0.5, generator=g)  # large enough for the clamps
        out, _ = mlp(x)
        gate, up = (x @ mlp.linear_fc1.weight.T).chunk(2, dim=-1)
        want = swiglu_oai(gate, up, 7.0) @ mlp.linear_fc2.weight.T
    assert out.dtype == torch.float64
    # The clamps engage on both sides, so the test sees them.
    assert bool((gate > 7).any()) and bool((up.abs() > 7).any())
    assert _rel(out, want) < 1e-13


# ------------------------------------------------------------------ specs
def test_tiny_m3_model_has_m3_layers_and_every_norm_follows_the_config(single_rank):
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config, recipe = _recipe_config("minimax_m3_tiny.yaml")
    model = _gpt(config, 256)
    layers = model.decoder.layers
    assert isinstance(layers[0].mlp, MLP) and layers[0].self_attention.indexer is None
    for layer in layers[1:]:
        assert isinstance(layer.mlp, MoELayer)
        assert layer.mlp.shared_experts is not None
        assert layer.mlp.router.expert_bias is not None
        assert layer.self_attention.indexer is not None
    norms = [m for n, m in model.named_modules()
             if n.endswith(("norm", "layernorm")) and not isinstance(m, IdentityOp)]
    # per layer: input, pre-MLP, q, k; MSA layers also index q, index k; plus the final norm
    assert len(norms) == 4 * 4 + 2 * 3 + 1
    assert all(isinstance(m, RMSNorm) and m.zero_centered_gamma and m.eps == 1e-6
               for m in norms), [type(m).__name__ for m in norms]

    plain = _toy_config(ToyM3(), layernorm_zero_centered_gamma=False)
    model = _gpt(plain, 128)
    index_norm = model.decoder.layers[1].self_attention.indexer.index_q_norm
    assert isinstance(index_norm, RMSNorm) and not index_norm.zero_centered_gamma
    assert isinstance(model.decoder.layers[1].input_layernorm, torch.nn.RMSNorm)  # Megatron's


def test_bad_moe_layer_freq_and_dispatcher_are_named():
    with pytest.raises((ValueError, AssertionError), match="moe_layer_freq"):
        _toy_config(ToyM3(), moe_layer_freq=[0, 1])
    with pytest.raises(ValueError, match="moe_token_dispatcher_type='alltoall'"):
        cpu_shim.check_cpu_config(_toy_config(ToyM3(), moe_token_dispatcher_type="alltoall"))


# ------------------------------------------------------------------ converter
def test_converter_round_trip_is_bitwise_and_names_what_is_wrong():
    toy = ToyM3(mtp_layers=1)
    config = _toy_config(toy, mtp_num_layers=1)
    for root, te in (("", False), ("language_model.", True)):
        hf = synthetic_checkpoint(toy, root=root)
        names = dict(hf_root=root, grouped_experts=te, fused_mlp_norm=te)
        mg = hf_to_megatron(hf, config, **names)
        back = megatron_to_hf(mg, config, **names)
        assert set(back) == set(hf)
        for name, tensor in hf.items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert "decoder.layers.2.mlp.experts.linear_fc1.weight5" in mg
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mg
    # The MTP module: its own norms and eh_proj, and a layer of the last layer's kind (MSA, MoE).
    assert mg["mtp.layers.0.eh_proj.weight"].shape == (toy.hidden, 2 * toy.hidden)
    assert "mtp.layers.0.mtp_model_layer.self_attention.indexer.index_q_proj.weight" in mg
    assert "mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc1.weight5" in mg
    qkv = mg["decoder.layers.0.self_attention.linear_qkv.weight"].view(2, 6, 16, toy.hidden)
    # GQA interleaving: group g = its 4 query heads, then k_g, then v_g
    k_proj = hf["language_model.model.layers.0.self_attn.k_proj.weight"].view(2, 16, toy.hidden)
    assert torch.equal(qkv[1, 4], k_proj[1])

    hf = synthetic_checkpoint(toy)
    with pytest.raises(ValueError, match="no tensor 'model.mtp.layers.0.hnorm.weight'"):
        hf_to_megatron({k: v for k, v in hf.items() if "hnorm" not in k}, config)
    config = _toy_config(ToyM3())  # no MTP layers: the checkpoint's MTP module is skipped
    mg = hf_to_megatron(hf, config)
    assert not any(k.startswith("mtp.") for k in mg)
    hf = synthetic_checkpoint(ToyM3())
    with pytest.raises(ValueError, match="no tensor 'model.layers.1.self_attn.index_k_norm"):
        hf_to_megatron({k: v for k, v in hf.items() if "1.self_attn.index_k_norm" not in k},
                       config)
    with pytest.raises(ValueError, match="not part of this model's config"):
        hf_to_megatron({**hf, "model.layers.0.self_attn.index_q_proj.weight": hf[
            "model.layers.1.self_attn.index_q_proj.weight"]}, config)
    bad = dict(hf)
    name = "model.layers.2.self_attn.k_proj.weight"
    bad[name] = bad[name][1:]
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(31, 32\); expected \(32, 32"):
        hf_to_megatron(bad, config)
    # The released VL checkpoint's vision tensors are not the text model's.
    extra = {"vision_tower.vision_model.x.weight": torch.zeros(1)}
    assert set(hf_to_megatron({**hf, **extra}, config)) == set(hf_to_megatron(hf, config))


def test_converted_model_computes_the_forward_written_from_m3_names(single_rank):
    toy = ToyM3(mtp_layers=1)
    hf = synthetic_checkpoint(toy, seed=1)
    model = _gpt(_toy_config(toy, mtp_num_layers=1), toy.vocab)
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf, model.config), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    # The model's own state dict converts back to the checkpoint, bit for bit (values: the model
    # holds the float32 router gate in params_dtype, float64 here, which float32 round-trips).
    back = megatron_to_hf(model.state_dict(), model.config)
    assert all(torch.equal(back[k].to(v.dtype), v) for k, v in hf.items())
    gates = {f"model.layers.{i}.block_sparse_moe.gate.weight" for i in (1, 2)}
    gates.add("model.mtp.layers.0.transformer_layer.block_sparse_moe.gate.weight")
    assert {k for k, v in hf.items() if back[k].dtype != v.dtype} == gates

    tokens = torch.randint(0, toy.vocab, (96,), generator=torch.Generator().manual_seed(5))
    want = hf_forward(hf, toy, tokens)
    model.eval()
    mtp_hidden = []
    hook = model.mtp.register_forward_hook(lambda m, i, out: mtp_hidden.append(out.chunk(2)[1]))
    with torch.no_grad():
        logits = model(tokens[None], torch.arange(96)[None],
                       attention_mask=torch.ones(1, 96, dtype=torch.long))
        mtp_logits = model.output_layer(mtp_hidden[0])[0][:, 0]
    hook.remove()
    assert logits.dtype == torch.float64 and logits.shape == (1, 96, toy.vocab)
    error = _rel(logits[0], want)
    assert error < 1e-12, f"relative error vs the forward from M3's names: {error:.3e}"
    # The MTP module (MSA + MoE, as the last layer) predicts token i + 2 at position i; its
    # indexer metrics are logged after the decoder's layers, as layer 4.
    attention = model.mtp.layers[0].mtp_model_layer.self_attention
    assert attention.indexer is not None and attention.metrics_layer_number == 4
    error = _rel(mtp_logits, hf_mtp_forward(hf, toy, tokens))
    assert error < 1e-12, f"MTP: relative error vs the forward from M3's names: {error:.3e}"
    # 96 tokens = 6 blocks of 16, top-2: the index branch decides what is attended.
    dense = hf_forward(hf, dataclasses.replace(toy, msa_layers=(0, 0, 0)), tokens)
    assert _rel(dense, want) > 1e-3
