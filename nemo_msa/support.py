"""The construction-time support gate and the runtime rejections of the MSA contract.

``require_msa_support`` runs when an MSA attention layer is built (inside
:meth:`nemo_msa.plan.MSAPlan.build`), never at the first step: a configuration MSA cannot run
fails before any batch is read. The runtime checks reject what the layer receives but does not
implement (KV caches, sliding windows, cross-attention, non-causal masks, CUDA-graph capture;
THD input is checked by the layer, nemo_msa.megatron.microbatch).

Config field names (Megatron TransformerConfig + the ``msa_*`` fields of
nemo_msa.megatron.config): num_attention_heads, num_query_groups, kv_channels,
msa_num_index_heads, msa_index_head_dim, msa_block_size, msa_topk, msa_init_blocks,
msa_local_blocks, msa_score_type, msa_backend; the precision fields fp8 (with
transformer_impl), fp8_dot_product_attention, fp8_multi_head_attention and fp4; and the feature
refused here: fused_single_qkv_rope (``apply_rope_fusion`` runs TE's fused RoPE at document
positions; its gate, which needs TE and a CUDA device, is nemo_msa.megatron.rope's). Whether
the backend runs context parallelism (a query subset) is its capability record's answer, asked
by nemo_msa.plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nemo_msa.backends.registry import AUTO, get_backend
from nemo_msa.limits import (
    MAX_TOP_K,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_DIMS,
    SUPPORTED_SCORE_TYPES,
    is_integer,
)


@dataclass(frozen=True)
class MSATopology:
    """What the MSA ops need to know about a layer's shape.

    Attributes:
        num_heads: query heads (whole layer, before tensor parallelism).
        num_kv_heads: KV heads (Megatron's num_query_groups).
        head_dim: per-head channels (Megatron's kv_channels).
        num_index_heads: indexer query heads; head h serves KV head h.
        index_head_dim: indexer channels.
        block_size: key-block size.
        top_k: blocks per query.
        init_blocks: forced sink blocks.
        local_blocks: forced local blocks (the own block and the ones before it).
        score_type: ``"max"`` or ``"lse"``.
    """

    num_heads: int = 64
    num_kv_heads: int = 4
    head_dim: int = 128
    num_index_heads: int = 4
    index_head_dim: int = 128
    block_size: int = 128
    top_k: int = 16
    init_blocks: int = 0
    local_blocks: int = 1
    score_type: str = "max"

    @classmethod
    def from_config(cls, config: Any) -> MSATopology:
        """Reads a Megatron TransformerConfig carrying the ``msa_*`` fields (an absent one takes
        :data:`DEFAULT_TOPOLOGY`'s value; index heads default to the KV heads)."""
        heads = config.num_attention_heads
        groups = getattr(config, "num_query_groups", None) or heads
        head_dim = getattr(config, "kv_channels", None) or config.hidden_size // heads
        default = DEFAULT_TOPOLOGY
        return cls(
            num_heads=heads,
            num_kv_heads=groups,
            head_dim=head_dim,
            num_index_heads=getattr(config, "msa_num_index_heads", groups),
            index_head_dim=getattr(config, "msa_index_head_dim", head_dim),
            block_size=getattr(config, "msa_block_size", default.block_size),
            top_k=getattr(config, "msa_topk", default.top_k),
            init_blocks=getattr(config, "msa_init_blocks", default.init_blocks),
            local_blocks=getattr(config, "msa_local_blocks", default.local_blocks),
            score_type=getattr(config, "msa_score_type", default.score_type),
        )

    def validate(self) -> None:
        """Raises ValueError naming the first field MSA cannot run."""
        checks = (
            ("num_attention_heads", self.num_heads, self.num_heads > 0, "> 0"),
            ("num_query_groups", self.num_kv_heads,
             self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
             f"a divisor of num_attention_heads={self.num_heads}"),
            ("kv_channels", self.head_dim, self.head_dim in SUPPORTED_HEAD_DIMS,
             f"one of {SUPPORTED_HEAD_DIMS}"),
            ("msa_num_index_heads", self.num_index_heads,
             self.num_index_heads == self.num_kv_heads,
             f"equal to num_query_groups={self.num_kv_heads} (index head h serves KV head h)"),
            ("msa_index_head_dim", self.index_head_dim,
             self.index_head_dim in SUPPORTED_HEAD_DIMS, f"one of {SUPPORTED_HEAD_DIMS}"),
            ("msa_block_size", self.block_size, self.block_size in SUPPORTED_BLOCK_SIZES,
             f"one of {SUPPORTED_BLOCK_SIZES}"),
            ("msa_topk", self.top_k, 1 <= self.top_k <= MAX_TOP_K, f"1..{MAX_TOP_K}"),
            ("msa_init_blocks", self.init_blocks, self.init_blocks >= 0, ">= 0"),
            ("msa_local_blocks", self.local_blocks, self.local_blocks >= 0, ">= 0"),
            ("msa_init_blocks + msa_local_blocks", self.init_blocks + self.local_blocks,
             self.init_blocks + self.local_blocks <= self.top_k,
             f"<= msa_topk={self.top_k} (forced blocks count inside the top-k)"),
            ("msa_score_type", self.score_type, self.score_type in SUPPORTED_SCORE_TYPES,
             f"one of {SUPPORTED_SCORE_TYPES}"),
        )
        for field_name, value, ok, expected in checks:
            if not is_integer(value) and field_name != "msa_score_type":
                raise ValueError(f"MSA cannot run {field_name}={value!r}; expected an integer")
            if not ok:
                raise ValueError(f"MSA cannot run {field_name}={value!r}; expected {expected}")


#: The production topology (MiniMax-M3): 64 query heads over 4 KV heads of 128 channels, 4 index
#: heads of 128, blocks of 128 tokens, top-16 with the own block forced, block score "max". The
#: one statement of these defaults: MSATransformerConfig's ``msa_*`` fields and the FLOPs model
#: read them here.
DEFAULT_TOPOLOGY = MSATopology()
#: The indexer loss's defaults (``msa_indexer_loss_coeff``, ``msa_indexer_loss_type``): stated
#: here for the config fields and for the plan, which reads duck-typed configs without them.
DEFAULT_INDEXER_LOSS_COEFF = 1.0
DEFAULT_INDEXER_LOSS_TYPE = "dense"


#: FP8 fields that would hand the attention FP8 tensors: MSA's kernels read bf16 q/k/v.
FP8_ATTENTION_FIELDS = ("fp8_dot_product_attention", "fp8_multi_head_attention")


@dataclass(frozen=True)
class PrecisionRefusal:
    """A precision setting MSA layers cannot run: the field, its value and what is expected.

    Attributes:
        field: the config field (``fp8``, ``fp8_dot_product_attention``, ...).
        value: its value.
        expected: what it must be instead, and why.
        error: the exception the construction gate raises for it.
    """

    field: str
    value: Any
    expected: str
    error: type[Exception]


def precision_refusal(field: Callable[[str], Any]) -> PrecisionRefusal | None:
    """The one statement of the precision rules (ADR 0036), for the construction gate and the
    recipe check alike: FP8 GEMMs around bf16 MSA attention.

    ``fp8`` runs the layer's Transformer Engine linears (QKV, output projection, MLP and
    experts) in FP8; their outputs, the attention's inputs, stay bf16. What would reach the MSA
    kernels in FP8 is refused, and so is FP8 without TE's layers, where Megatron's local linears
    would ignore it and train in bf16 silently.

    Args:
        field: the value of a config field by name (``transformer_impl`` unset means Megatron's
            default, ``"transformer_engine"``).

    Returns:
        The first refusal, or None where the precision settings can run.
    """
    fp8, fp4 = field("fp8"), field("fp4")
    if fp8:
        impl = field("transformer_impl") or "transformer_engine"
        if impl != "transformer_engine":
            return PrecisionRefusal(
                "fp8", fp8, f"null/None with transformer_impl={impl!r} (FP8 GEMMs are Transformer "
                "Engine's; set transformer_impl='transformer_engine')", ValueError)
        for flag in FP8_ATTENTION_FIELDS:
            if field(flag):
                return PrecisionRefusal(
                    flag, field(flag), "false: the MSA kernels read bf16 q/k/v (the FP8 GEMMs "
                    "around them are supported)", NotImplementedError)
    if fp4:
        return PrecisionRefusal(
            "fp4", fp4, "null/None: MSA layers are not built for FP4 (FP4 GEMMs need SM100, "
            "untested here; the MSA kernels read bf16 q/k/v)", NotImplementedError)
    return None


def require_msa_support(config: Any, backend: str | None = None) -> MSATopology:
    """The device-free part of the construction gate (:meth:`nemo_msa.plan.MSAPlan.build` runs
    it, then resolves the backend for the device and asks its capability record).

    Args:
        config: a Megatron TransformerConfig (or any object with its field names and the
            ``msa_*`` fields).
        backend: the requested backend name (``msa_backend``), checked against the registry.

    Returns:
        The validated topology.

    Raises:
        NotImplementedError: FP8 attention (fp8_dot_product_attention,
            fp8_multi_head_attention), FP4, or fused single-QKV RoPE (fused_single_qkv_rope).
        ValueError: FP8 GEMMs without Transformer Engine's layers (``transformer_impl``), or a
            topology, score type or backend name MSA cannot run; names field and value.
    """
    refusal = precision_refusal(lambda name: getattr(config, name, None))
    if refusal is not None:
        raise refusal.error(f"config.{refusal.field}={refusal.value!r}: expected "
                            f"{refusal.expected}")
    if getattr(config, "fused_single_qkv_rope", False):
        raise NotImplementedError(
            "MSA attention does not support fused_single_qkv_rope=True: Transformer Engine's "
            "fused QKV RoPE takes sbhd/bshd rows with one start position per row and no "
            "cu_seqlens, so it cannot restart positions at each packed document (and Megatron "
            "runs it only without q/k norms); set it to False (apply_rope_fusion=True runs TE's "
            "fused RoPE at document positions)"
        )
    topology = MSATopology.from_config(config)
    topology.validate()
    if backend is not None and backend != AUTO:
        get_backend(backend)  # ValueError for an unknown name
    return topology


def reject_cuda_graph_capture(op: str) -> None:
    """MSA derives its layout on the host once per microbatch, which graph capture forbids."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{op} cannot run under CUDA-graph capture: the MSA layout needs one host "
            "synchronization per microbatch; disable CUDA graphs for MSA layers"
        )


def check_runtime_arguments(
    *,
    inference_context: Any = None,
    inference_params: Any = None,
    key_value_states: Any = None,
    packed_seq_params: Any = None,
    window_size: Any = None,
    attn_mask_type: Any = None,
    rotary_pos_cos_sin: Any = None,
) -> None:
    """Rejects what an MSA attention layer receives but does not implement.

    ``packed_seq_params`` (THD input) is accepted here and checked where the layout is built
    (:func:`nemo_msa.megatron.microbatch.context_parallel_layout_for_layer`).

    Raises:
        NotImplementedError: KV cache / inference, sliding windows, cross-attention
            (key_value_states), or a non-causal mask type.
        RuntimeError: called during CUDA-graph capture.
    """
    del packed_seq_params  # THD input: checked where its layout is built
    if inference_context is not None or inference_params is not None:
        raise NotImplementedError(
            "MSA attention has no KV-cache / inference path (inference_context given); it is a "
            "training attention"
        )
    if key_value_states is not None:
        raise NotImplementedError(
            "MSA attention is self-attention only; key_value_states (cross-attention) was given"
        )
    if window_size is not None and tuple(window_size) != (-1, 0) and tuple(window_size) != (
        -1,
        -1,
    ):
        raise NotImplementedError(
            f"MSA attention does not support sliding windows (window_size={window_size!r})"
        )
    if attn_mask_type is not None:
        name = getattr(attn_mask_type, "name", str(attn_mask_type))
        if name not in ("causal", "padding_causal"):
            raise NotImplementedError(
                f"MSA attention is causal; attn_mask_type={name} is not supported"
            )
    if rotary_pos_cos_sin is not None:
        raise NotImplementedError(
            "MSA attention applies RoPE with per-document positions; precomputed "
            "rotary_pos_cos_sin (fused RoPE) is not supported"
        )
    reject_cuda_graph_capture("MSA attention")
