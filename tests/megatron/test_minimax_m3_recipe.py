"""recipes/minimax_m3_msa.yaml builds MiniMax-M3 at full size on the meta device (no memory), and
its parameter count is M3's: about 428B in total and about 23B active per token."""

from __future__ import annotations

import torch

from nemo_msa.training.recipe import RECIPES_DIR, load_recipe

#: The full recipe as the CPU can build it: Megatron-only modules, one process.
_LOCAL = ["model.transformer_impl=local", "model.moe_grouped_gemm=false",
          "model.tensor_model_parallel_size=1", "model.pipeline_model_parallel_size=1",
          "model.expert_model_parallel_size=1", "model.sequence_parallel=false",
          "model.moe_token_dispatcher_type=allgather", "model.bf16=false"]


def _analytic_counts() -> tuple[int, int, int]:
    """(total, active without embeddings, embeddings + output layer) from M3's published sizes."""
    h, vocab, layers, dense_layers = 6144, 200064, 60, 3
    attention = h * (64 * 128) * 2 + h * (4 * 128) * 2 + 2 * 128  # q, o, k, v, q/k norms
    index = h * 4 * 128 + h * 128 + 2 * 128  # index_q, index_k, their norms
    norms = 2 * h
    expert = 3 * h * 3072
    dense_mlp = 3 * h * 12288
    router = 128 * h
    moe_layers = layers - dense_layers
    embeddings = 2 * vocab * h
    shared = (layers * (attention + norms) + moe_layers * index + dense_layers * dense_mlp
              + moe_layers * (router + expert) + h)  # every token; + final norm
    total = shared + moe_layers * 128 * expert + embeddings
    active = shared + moe_layers * 4 * expert
    return total, active, embeddings


def test_full_m3_recipe_builds_on_meta_with_m3_parameter_counts(single_rank):
    from megatron.core.models.gpt import GPTModel

    from nemo_msa.megatron.layer_specs import get_msa_decoder_block_spec
    from nemo_msa.training.build import build_config
    from nemo_msa.training.setup import RunContext

    recipe = load_recipe(RECIPES_DIR / "minimax_m3_msa.yaml", _LOCAL)
    config = build_config(recipe, RunContext(0, 1, torch.device("cpu"), True, False))
    with torch.device("meta"):
        model = GPTModel(config, get_msa_decoder_block_spec(config),
                         vocab_size=recipe.gpt.vocab_size,
                         max_sequence_length=recipe.gpt.seq_length,
                         position_embedding_type="rope", rotary_percent=recipe.gpt.rotary_percent,
                         rotary_base=recipe.gpt.rotary_base,
                         share_embeddings_and_output_weights=False)
    params = dict(model.named_parameters())
    assert {p.device.type for p in params.values()} == {"meta"}  # nothing was allocated
    total = sum(p.numel() for p in params.values())
    routed = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    embeddings = sum(p.numel() for n, p in params.items()
                     if n.startswith(("embedding.", "output_layer.")))
    active = total - routed + routed * config.moe_router_topk // config.num_moe_experts
    assert (total, active - embeddings, embeddings) == _analytic_counts()
    # MiniMax's model card: ~428B total, ~23B activated. The total is within 1% (426.17B; the
    # card's figure includes the vision tower). Active per token without the embedding and output
    # layer is 23.50B (25.96B with them): 2.2% above the card's rounded ~23B (ADR 0027).
    assert abs(total - 428e9) / 428e9 < 0.01, total
    assert abs((active - embeddings) - 23e9) / 23e9 < 0.025, active - embeddings
    assert len(model.decoder.layers) == 60
    moe = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    assert moe == ["MLP"] * 3 + ["MoELayer"] * 57
    msa = [layer.self_attention.indexer is not None for layer in model.decoder.layers]
    assert msa == [False] * 3 + [True] * 57
