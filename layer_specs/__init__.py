"""Megatron-Core layer specs for MSA: re-exports :mod:`nemo_msa.megatron.layer_specs`."""

from nemo_msa.megatron.layer_specs import (
    TRANSFORMER_IMPLS,
    get_msa_decoder_block_spec,
    get_msa_decoder_layer_specs,
    get_msa_layer_spec,
    get_msa_self_attention_spec,
    spec_provider,
    te_unavailable_reason,
)

__all__ = [
    "TRANSFORMER_IMPLS",
    "get_msa_decoder_block_spec",
    "get_msa_decoder_layer_specs",
    "get_msa_layer_spec",
    "get_msa_self_attention_spec",
    "spec_provider",
    "te_unavailable_reason",
]
