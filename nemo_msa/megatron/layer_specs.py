"""Megatron-Core layer specs for MSA block-sparse attention (MiniMax-M3 style).

Put MSA layers into a GPT model::

    from megatron.core.models.gpt import GPTModel
    from nemo_msa.megatron import MSATransformerConfig
    from nemo_msa.megatron.layer_specs import get_msa_decoder_block_spec

    config = MSATransformerConfig(num_layers=8, hidden_size=1024, num_attention_heads=16,
                                  num_query_groups=4, kv_channels=128, rotary_percent=0.5,
                                  msa_layer_pattern="DSSS" * 2, attention_dropout=0.0, ...)
    model = GPTModel(config, get_msa_decoder_block_spec(config, vp_stage=None),
                     vocab_size=..., max_sequence_length=..., position_embedding_type="rope",
                     rotary_percent=0.5, rotary_base=5_000_000)
    loss = model(tokens, position_ids, attention_mask=packed_seq_ids, labels=labels)

``attention_mask`` carries the loader's packed_seq_ids [b, s] (document ids, 0 = padding);
every MSA and dense layer of the pattern attends within documents and rotates at document
positions (docs/adr/0005-document-map-to-layers.md).

Two implementations, as Megatron's ``transformer_impl``: ``"local"`` (Megatron-Core modules
only; runs on the CPU) and ``"transformer_engine"`` (TE linears and norms where TE is
installed). The modules come from Megatron's own backend spec providers
(``LocalSpecProvider``, ``TESpecProvider``), as Megatron's GPT specs build theirs; "backend" in
nemo_msa means the MSA kernels (nemo_msa.backends), never this choice. The input layernorm is not
fused into ``linear_qkv`` in either, because the indexer reads the normalized hidden states too;
the ``sharded_state_dict_keys_map`` keeps the checkpoint names of Megatron's fused layout, so
local and TE checkpoints load into each other.

Specs are built fresh per call and never mutated afterwards: the same spec object is shared by
all layers of one kind (as Megatron's own block specs do). This module sits above the MSA
modules and below training (ADR 0017); ``layer_specs`` re-exports it.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
    get_mtp_num_layers_to_build,
)
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from nemo_msa.megatron.config import normalize_layer_pattern, normalize_moe_layer_freq
from nemo_msa.megatron.core_attention import MSACoreAttention
from nemo_msa.megatron.indexer import MSAIndexer, MSAIndexerSubmodules, ReplicatedLinear
from nemo_msa.megatron.msa_attention import MSASelfAttention, MSASelfAttentionSubmodules
from nemo_msa.megatron.norms import RMSNorm

__all__ = [
    "TRANSFORMER_IMPLS",
    "get_msa_decoder_block_spec",
    "get_msa_decoder_layer_specs",
    "get_msa_layer_spec",
    "get_msa_mtp_block_spec",
    "get_msa_self_attention_spec",
    "layer_norm_builder",
    "moe_layer_flags",
    "spec_provider",
    "te_unavailable_reason",
]

TRANSFORMER_IMPLS = ("local", "transformer_engine")

# The fused-layernorm checkpoint names (Megatron's TE spec) for the separate norms used here.
_KEYS_MAP = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def te_unavailable_reason() -> str | None:
    """None when Transformer Engine imports, else why not (for skips and errors)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # ImportError, or a CUDA/ABI error raised on import
        return f"transformer_engine does not import: {type(error).__name__}: {error}"
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        return "megatron.core.extensions.transformer_engine reports HAVE_TE=False"
    return None


def _resolve_impl(config: TransformerConfig | None, transformer_impl: str | None) -> str:
    if transformer_impl is None:
        impl = getattr(config, "transformer_impl", "local") if config is not None else "local"
        transformer_impl = "transformer_engine" if impl == "transformer_engine" else "local"
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(
            f"transformer_impl={transformer_impl!r}; expected one of {TRANSFORMER_IMPLS}")
    if transformer_impl == "transformer_engine":
        reason = te_unavailable_reason()
        if reason is not None:
            raise ImportError(
                f"transformer_impl='transformer_engine' (config.transformer_impl="
                f"{getattr(config, 'transformer_impl', None)!r}, Megatron's default) needs "
                f"Transformer Engine; {reason}. Set transformer_impl='local' to build the "
                "Megatron-Core-only spec"
            )
    return transformer_impl


def spec_provider(transformer_impl: str) -> BackendSpecProvider:
    """Megatron's backend spec provider of ``transformer_impl`` ("local" or
    "transformer_engine", already checked by :func:`_resolve_impl`)."""
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalSpecProvider()


def _check_sequence_parallel(config: TransformerConfig | None, transformer_impl: str) -> None:
    if config is not None and config.sequence_parallel and transformer_impl == "local":
        raise ValueError(
            "sequence_parallel=True with transformer_impl='local': Megatron's local norms "
            "(torch.nn.LayerNorm/RMSNorm) do not support sequence parallelism; use "
            "transformer_impl='transformer_engine' or sequence_parallel=False"
        )


def layer_norm_builder(
    config: TransformerConfig | None, transformer_impl: str, for_qk: bool = False
):
    """The norm of the layer's norms (input, pre-MLP, q/k, final) for ``transformer_impl``.

    Megatron's provider's norm, except where the local one cannot honour the config: with
    ``layernorm_zero_centered_gamma=True`` Megatron's local norm (``WrappedTorchNorm``) refuses,
    so the local spec builds :class:`nemo_msa.megatron.norms.RMSNorm` (``x * (1 + w)``).
    TE's ``TENorm`` reads ``layernorm_zero_centered_gamma`` itself.

    Raises:
        ValueError: zero-centred gamma with a local LayerNorm (no local implementation).
    """
    normalization = getattr(config, "normalization", "LayerNorm")
    rms = normalization == "RMSNorm"
    zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
    if transformer_impl == "local" and zero_centered:
        if not rms:
            raise ValueError(
                f"layernorm_zero_centered_gamma=True with normalization={normalization!r} and "
                "transformer_impl='local': the local spec has a zero-centred RMSNorm only; use "
                "normalization='RMSNorm' or transformer_impl='transformer_engine'"
            )
        return RMSNorm
    return spec_provider(transformer_impl).layer_norm(rms_norm=rms, for_qk=for_qk)


def moe_layer_flags(config: TransformerConfig | None) -> tuple[bool, ...]:
    """One bool per layer (True = MoE MLP) from ``num_moe_experts`` and ``moe_layer_freq``
    (:func:`nemo_msa.megatron.config.normalize_moe_layer_freq`); empty without a config."""
    if config is None:
        return ()
    return normalize_moe_layer_freq(getattr(config, "moe_layer_freq", 1), config.num_layers,
                                    getattr(config, "num_moe_experts", None))


def get_msa_self_attention_spec(
    config: TransformerConfig | None = None,
    *,
    sparse: bool = True,
    transformer_impl: str | None = None,
    mtp: bool = False,
) -> ModuleSpec:
    """Spec of the MSA self-attention (``sparse=True``) or its dense-document sibling.

    Args:
        config: the MSATransformerConfig (reads qk_layernorm, normalization, transformer_impl);
            None builds the local spec without q/k norms.
        sparse: True for an MSA layer (with the indexer), False for a dense layer of a mixed
            pattern (document-causal dense attention, no indexer).
        transformer_impl: "local", "transformer_engine", or None (config.transformer_impl).
        mtp: the attention of a multi-token-prediction layer (its indexer metrics are logged
            after the decoder's layers, as Megatron's router numbers MTP layers).

    Returns:
        ModuleSpec of :class:`nemo_msa.megatron.MSASelfAttention`.
    """
    impl = _resolve_impl(config, transformer_impl)
    provider = spec_provider(impl)
    qk_layernorm = bool(getattr(config, "qk_layernorm", False))
    column, row = provider.column_parallel_linear(), provider.row_parallel_linear()
    # The shared index key head is replicated: TE's plain linear, or this package's.
    replicated = provider.linear() if impl == "transformer_engine" else ReplicatedLinear
    qk_norm = layer_norm_builder(config, impl, for_qk=True) if qk_layernorm else IdentityOp

    indexer = None
    if sparse:
        indexer = ModuleSpec(
            module=MSAIndexer,
            submodules=MSAIndexerSubmodules(
                index_q_proj=column,
                index_k_proj=replicated,
                # Replicated over TP with their own gradient reduction, in both implementations;
                # ``1 + w`` or ``w`` by config.layernorm_zero_centered_gamma, like the other norms.
                index_q_norm=RMSNorm,
                index_k_norm=RMSNorm,
            ),
        )
    params = {"attn_mask_type": AttnMaskType.causal}
    if mtp:
        params["mtp_layer"] = True
    return ModuleSpec(
        module=MSASelfAttention,
        params=params,
        submodules=MSASelfAttentionSubmodules(
            linear_qkv=column,
            core_attention=MSACoreAttention,
            linear_proj=row,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
            indexer=indexer,
        ),
    )


def get_msa_layer_spec(
    config: TransformerConfig | None = None,
    *,
    sparse: bool = True,
    moe: bool | None = None,
    transformer_impl: str | None = None,
    mtp: bool = False,
) -> ModuleSpec:
    """Spec of one transformer layer with MSA (or dense-document) self-attention.

    The MLP (dense, or Megatron's MoE layer: router, routed experts, shared expert, by the
    config's ``num_moe_experts``, ``moe_grouped_gemm``, ``moe_shared_expert_intermediate_size``)
    comes from Megatron's GPT layer spec of the same implementation; the norms follow
    ``normalization`` and ``layernorm_zero_centered_gamma`` (:func:`layer_norm_builder`).

    Args:
        config: the MSATransformerConfig (None: local, LayerNorm, dense MLP).
        sparse: MSA layer (True) or dense-document layer (False).
        moe: MoE MLP (True) or dense MLP (False); None: MoE whenever ``num_moe_experts`` is set.
        transformer_impl: "local", "transformer_engine", or None (config.transformer_impl).
        mtp: the layer of a multi-token-prediction module (:func:`get_msa_mtp_block_spec`).

    Returns:
        ModuleSpec of a Megatron ``TransformerLayer``.

    Raises:
        ValueError: an unknown implementation, or sequence parallelism with the local one.
        ImportError: "transformer_engine" where TE does not import.
    """
    impl = _resolve_impl(config, transformer_impl)
    _check_sequence_parallel(config, impl)
    num_experts = getattr(config, "num_moe_experts", None)
    if moe is None:
        moe = num_experts is not None
    if moe and num_experts is None:
        raise ValueError("moe=True needs config.num_moe_experts; it is None")
    num_experts = num_experts if moe else None
    grouped = bool(getattr(config, "moe_grouped_gemm", False)) and moe
    normalization = getattr(config, "normalization", "LayerNorm")
    if impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_submodules,
        )

        base = get_gpt_layer_with_transformer_engine_submodules(
            num_experts=num_experts, moe_grouped_gemm=grouped
        )
        # Not fused into linear_qkv: the indexer reads the normalized hidden states too.
        input_layernorm = layer_norm_builder(config, impl)
        keys_map = {"input_layernorm.": _KEYS_MAP["input_layernorm."]}
    else:
        base = get_gpt_layer_local_submodules(
            num_experts=num_experts, moe_grouped_gemm=grouped, normalization=normalization
        )
        input_layernorm = layer_norm_builder(config, impl)
        keys_map = dict(base.sharded_state_dict_keys_map or _KEYS_MAP)
        if moe:
            # TE's MoE layer keeps its pre-MLP norm apart (nothing to fuse it into), so a local
            # MoE layer must not save it under the fused name, or neither spec loads the
            # other's checkpoint (Megatron's own local spec maps it; test_te_spec.py).
            keys_map.pop("pre_mlp_layernorm.", None)
    pre_mlp_layernorm = base.pre_mlp_layernorm
    if pre_mlp_layernorm is not IdentityOp:  # TE's dense MLP fuses it into linear_fc1
        pre_mlp_layernorm = layer_norm_builder(config, impl)
    submodules = TransformerLayerSubmodules(
        input_layernorm=input_layernorm,
        self_attention=get_msa_self_attention_spec(config, sparse=sparse, transformer_impl=impl,
                                                   mtp=mtp),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=pre_mlp_layernorm,
        mlp=base.mlp,
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=keys_map,
    )
    return ModuleSpec(module=TransformerLayer, submodules=submodules)


def get_msa_decoder_layer_specs(
    config: TransformerConfig, transformer_impl: str | None = None
) -> list[ModuleSpec]:
    """One layer spec per layer of the whole model, by ``config.msa_layer_pattern`` (MSA or
    dense attention) and ``config.moe_layer_freq`` (MoE or dense MLP, :func:`moe_layer_flags`).

    Args:
        config: the MSATransformerConfig.
        transformer_impl: "local", "transformer_engine", or None (config.transformer_impl).

    Returns:
        ``config.num_layers`` specs; layers of one (attention, MLP) kind share one spec object.
    """
    flags = normalize_layer_pattern(getattr(config, "msa_layer_pattern", None), config.num_layers)
    moe_flags = moe_layer_flags(config)
    specs: dict[tuple[bool, bool], ModuleSpec] = {}
    for kind in sorted(set(zip(flags, moe_flags, strict=True))):
        specs[kind] = get_msa_layer_spec(config, sparse=kind[0], moe=kind[1],
                                         transformer_impl=transformer_impl)
    return [specs[kind] for kind in zip(flags, moe_flags, strict=True)]


def get_msa_decoder_block_spec(
    config: TransformerConfig,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    transformer_impl: str | None = None,
) -> TransformerBlockSubmodules:
    """Decoder-block spec of this pipeline stage / virtual chunk, MSA and dense by the pattern.

    Mirrors Megatron's ``get_gpt_decoder_block_spec``: the layers of the stage (``pp_rank``,
    default the current rank) and virtual chunk ``vp_stage`` are sliced out of the full pattern,
    honouring ``pipeline_model_parallel_layout`` and uneven first/last stages.

    Args:
        config: the MSATransformerConfig.
        vp_stage: virtual pipeline chunk (None without VPP).
        pp_rank: pipeline rank (None: this process's).
        transformer_impl: "local", "transformer_engine", or None (config.transformer_impl).

    Returns:
        ``TransformerBlockSubmodules`` for ``GPTModel(config, transformer_layer_spec=...)``.
    """
    impl = _resolve_impl(config, transformer_impl)
    layer_specs = get_msa_decoder_layer_specs(config, transformer_impl=impl)
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        if not isinstance(layout, PipelineParallelLayerLayout):
            raise ValueError(
                f"pipeline_model_parallel_layout={layout!r}; expected a "
                "PipelineParallelLayerLayout (TransformerConfig converts strings)"
            )
        local_specs = [
            layer_specs[layer_id]
            for layer_id in layout.get_layer_id_list(
                layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
            )
        ]
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_specs = layer_specs[offset : offset + count]
    final_norm = layer_norm_builder(config, impl)
    return TransformerBlockSubmodules(layer_specs=local_specs, layer_norm=final_norm)


def get_msa_mtp_block_spec(
    config: TransformerConfig,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    transformer_impl: str | None = None,
) -> MultiTokenPredictionBlockSubmodules | None:
    """Megatron's multi-token-prediction (MTP) block with MSA layers, for ``GPTModel``'s
    ``mtp_block_spec`` (docs/adr/0053-mtp-with-msa-layers.md).

    Each of the ``config.mtp_num_layers`` depths is Megatron's ``MultiTokenPredictionLayer``:
    ``enorm`` and ``hnorm`` (the norms of the next token's embedding and of the hidden state),
    ``eh_proj`` (their concatenation, embedding first, projected back to the hidden size), one
    transformer layer, and ``final_layernorm``; the output layer and the embedding are the main
    model's. The transformer layer is of the kind of the decoder's last layer (attention by
    ``msa_layer_pattern``, MLP by ``moe_layer_freq``), Megatron's own rule
    (``get_gpt_mtp_block_spec``): for MiniMax-M3 MSA with the MoE MLP, as M3's released MTP
    module. The norms follow ``layernorm_zero_centered_gamma`` like every other norm.

    Args:
        config: the MSATransformerConfig with ``mtp_num_layers`` set.
        vp_stage: virtual pipeline chunk (None without VPP).
        pp_rank: pipeline rank (None: this process's).
        transformer_impl: "local", "transformer_engine", or None (config.transformer_impl).

    Returns:
        The block's submodules on the stage that holds the MTP layers (the last), else None.
    """
    if not getattr(config, "mtp_num_layers", None):
        return None
    if get_mtp_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank) == 0:
        return None
    impl = _resolve_impl(config, transformer_impl)
    sparse = normalize_layer_pattern(getattr(config, "msa_layer_pattern", None),
                                     config.num_layers)[-1]
    moe = bool(moe_layer_flags(config)[-1])
    norm = layer_norm_builder(config, impl)
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm,
            hnorm=norm,
            eh_proj=spec_provider(impl).column_parallel_linear(),
            mtp_model_layer=get_msa_layer_spec(config, sparse=sparse, moe=moe,
                                               transformer_impl=impl, mtp=True),
            layer_norm=norm,
        ),
    )
    # Megatron builds one layer per depth (one in all with mtp_use_repeated_layer), all on one
    # stage; its block checks that.
    depths = 1 if config.mtp_use_repeated_layer else config.mtp_num_layers
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * depths)
