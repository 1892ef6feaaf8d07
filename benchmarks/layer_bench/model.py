"""The benchmark's model: its shape, the cases (one MSATransformerConfig each), the one-rank
process group and the one-layer MiniMax-M3-shaped GPTModel built from this project's spec."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.activations import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module

from layer_specs import get_msa_decoder_block_spec
from nemo_msa.megatron import MSATransformerConfig, cpu_shim

# The model rows (one MSATransformerConfig each, see case_config) and the attention-only rows.
CASES = ("dense", "msa_loss_off", "msa_sparse_loss", "msa_dense_loss", "msa_warmup")
ATTENTION_ROWS = ("dense_attention", "cudnn_attention")


@dataclass(frozen=True)
class Shape:
    """Model shape of the benchmark.

    Attributes:
        hidden: hidden size.
        ffn: FFN hidden size (SwiGLU: fc1 is 2 * ffn wide).
        heads: query heads.
        groups: KV heads.
        head_dim: channels per head (kv_channels).
        index_heads: indexer heads.
        index_dim: indexer head dim.
        block: MSA block size.
        topk: MSA blocks per query.
        vocab: vocabulary size.
    """

    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    index_heads: int
    index_dim: int
    block: int
    topk: int
    vocab: int


M3 = Shape(6144, 16384, 64, 4, 128, 4, 128, 128, 16, 8192)
TINY = Shape(128, 256, 4, 2, 32, 2, 32, 16, 4, 256)


@dataclass(frozen=True)
class Block:
    """The real MiniMax-M3 block (``--m3-block``): one MoE layer as recipes/minimax_m3_msa.yaml
    builds its layers 4-60 (SwiGLU-OAI, Gemma RMSNorm eps 1e-6, QK norm, sigmoid top-k routing
    with expert bias and scaling, one shared expert): with the TE spec TE's grouped GEMM over
    the experts (``moe_grouped_gemm``, as the recipe), with the local spec Megatron's
    SequentialMLP.

    Attributes:
        experts: routed experts built (M3: 128).
        topk: experts per token.
        expert_ffn: routed expert FFN size.
        shared_ffn: shared expert FFN size.
    """

    experts: int
    topk: int
    expert_ffn: int
    shared_ffn: int


#: All of M3's 128 experts fit one H200 here: 128 x 56.6M = 7.25B parameters, 14.5 GB of bf16
#: weights + 14.5 GB of bf16 gradients (the benchmark has no optimizer state).
M3_BLOCK = Block(128, 4, 3072, 3072)
TINY_BLOCK = Block(4, 2, 64, 64)


def block_fields(block: Block, on_gpu: bool, transformer_impl: str = "local") -> dict:
    """The MSATransformerConfig fields of the M3 block (MoE, activation, norms); the experts run
    TE's grouped GEMM with the TE spec, as recipes/minimax_m3_msa.yaml trains them."""
    return dict(
        moe_grouped_gemm=transformer_impl == "transformer_engine",
        num_moe_experts=block.experts, moe_ffn_hidden_size=block.expert_ffn,
        moe_shared_expert_intermediate_size=block.shared_ffn, moe_router_topk=block.topk,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.0, moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3,
        # All-to-all on the GPU (the recipe's); its CUDA stream has no CPU path.
        moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        activation_func=quick_gelu, activation_func_clamp_value=7.0, glu_linear_offset=1.0,
        layernorm_zero_centered_gamma=True, layernorm_epsilon=1e-6, qk_layernorm=True,
    )


def init_single_rank(on_gpu: bool) -> None:
    """A one-rank process group (NCCL on the GPU, gloo + the CPU shim on the CPU), TP = PP = 1."""
    if not on_gpu:
        cpu_shim.install()
    if not torch.distributed.is_initialized():
        if on_gpu:
            torch.cuda.set_device(0)
        torch.distributed.init_process_group(
            backend="nccl" if on_gpu else "gloo",
            store=torch.distributed.HashStore(),
            rank=0,
            world_size=1,
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)


def case_config(case: str, shape: Shape, on_gpu: bool, block: Block | None = None,
                layers: int = 1, transformer_impl: str = "local",
                fp8: str | None = None, fp8_recipe: str = "delayed",
                deterministic: bool = False) -> MSATransformerConfig:
    """The MSATransformerConfig of one case.

    Args:
        case: one of :data:`CASES`.
        shape: the model shape.
        on_gpu: bf16 on the GPU; fp32 with the CPU shim's overrides otherwise.
        block: the M3 block's MoE (None: the dense SwiGLU stand-in layer).
        layers: transformer layers (every one of the case's kind).
        transformer_impl: "local" (Megatron-Core modules) or "transformer_engine" (TE linears
            and norms; GPU only).
        fp8: None (bf16 GEMMs), "hybrid" or "e4m3": the TE linears' FP8 format (the attention
            and the indexer stay bf16, ADR 0036).
        fp8_recipe: Megatron's ``fp8_recipe`` with ``fp8``.
        deterministic: Megatron's ``deterministic_mode`` (the process must have
            ``torch.use_deterministic_algorithms(True)`` on; ADR 0050).

    Returns:
        The config (``layers`` layers).

    Raises:
        ValueError: an unknown case, or FP8 without TE on the GPU.
    """
    if case not in CASES:
        raise ValueError(f"case={case!r}; expected one of {CASES}")
    if fp8 is not None and (transformer_impl != "transformer_engine" or not on_gpu):
        raise ValueError(f"fp8={fp8!r} needs transformer_impl='transformer_engine' on the GPU "
                         f"(got {transformer_impl!r}, on_gpu={on_gpu})")
    msa = {
        "dense": {"msa_layer_pattern": "D"},
        "msa_loss_off": {"msa_indexer_loss_coeff": 0.0},
        "msa_sparse_loss": {"msa_indexer_loss_coeff": 1.0, "msa_indexer_loss_type": "sparse"},
        "msa_dense_loss": {"msa_indexer_loss_coeff": 1.0, "msa_indexer_loss_type": "dense"},
        "msa_warmup": {"msa_indexer_loss_coeff": 1.0, "msa_dense_warmup_steps": 10**9},
    }[case]
    precision = (
        {"bf16": True, "params_dtype": torch.bfloat16}
        if on_gpu
        else dict(cpu_shim.cpu_config_overrides())
    )
    if fp8 is not None:
        precision.update(fp8=fp8, fp8_recipe=fp8_recipe, fp8_amax_history_len=1024,
                         fp8_amax_compute_algo="max")
    extra = block_fields(block, on_gpu, transformer_impl) if block is not None else {}
    fields = dict(
        num_layers=layers,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads,
        num_query_groups=shape.groups,
        kv_channels=shape.head_dim,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        transformer_impl=transformer_impl,
        msa_num_index_heads=shape.index_heads,
        msa_index_head_dim=shape.index_dim,
        msa_block_size=shape.block,
        msa_topk=shape.topk,
        msa_layer_pattern=msa.pop("msa_layer_pattern", "S") * layers,
        deterministic_mode=deterministic,
        **msa,
        **precision,
    )
    return MSATransformerConfig(**{**fields, **extra})


def build_model(config: MSATransformerConfig, shape: Shape, max_tokens: int, on_gpu: bool):
    """GPTModel (``config.num_layers`` layers, this project's spec), wrapped in Float16Module
    for bf16 on the GPU.

    Args:
        config: the case's config (:func:`case_config`).
        shape: the model shape (its vocabulary).
        max_tokens: the longest row the model will see (its maximum sequence length).
        on_gpu: move the model to the GPU and wrap it for bf16.

    Returns:
        The model, in training mode.
    """
    model = GPTModel(
        config,
        get_msa_decoder_block_spec(config),
        vocab_size=shape.vocab,
        max_sequence_length=max_tokens,
        position_embedding_type="rope",
        rotary_percent=0.5,
        rotary_base=5_000_000,
        share_embeddings_and_output_weights=False,
    )
    if on_gpu:
        model = Float16Module(config, model.cuda())
    return model.train()

