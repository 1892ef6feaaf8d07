"""Adapters between the training loop and the MSA Megatron modules (nemo_msa.megatron).

The loop needs five things from the MSA layers, and this module is the only place that knows
how the Megatron integration provides them:

- the decoder spec of a model chunk (``layer_specs.get_msa_decoder_block_spec``);
- how a microbatch's document map reaches the attention: ``packed_seq_ids`` is passed to
  ``GPTModel.forward`` as ``attention_mask`` (source 2 of the contract), which Megatron hands
  unchanged to every layer (``model_forward_kwargs``);
- the indexer-loss scale hook that Megatron's schedules call per microbatch
  (``config.experimental_attention_variant_loss_scale_func``, as for DSA) (``configure``);
- the dense warm-up switch, set before each step (``set_training_phase``), and which
  optimizer parameters are the indexer's, so that only the indexer learns in the warm-up
  (``indexer_param_ids``);
- the indexer loss and selection recall of the last step (``pop_step_metrics``).

A model section without MSA fields (Megatron's plain TransformerConfig) trains a dense GPT with
Megatron's local spec; then these functions do nothing. The tests use that as a reference.
"""

from __future__ import annotations

from typing import Any

import torch


def is_msa_config(config: Any) -> bool:
    """Whether the model config is the MSA config (so the MSA spec and hooks apply)."""
    try:
        from nemo_msa.megatron.config import MSATransformerConfig
    except ImportError:
        return False
    return isinstance(config, MSATransformerConfig)


def layer_spec(config: Any, vp_stage: int | None, pp_rank: int | None):
    """The decoder spec of one model chunk: MSA when configured, else Megatron's local spec."""
    if is_msa_config(config):
        from layer_specs import get_msa_decoder_block_spec

        return get_msa_decoder_block_spec(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if getattr(config, "transformer_impl", "local") == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(normalization=getattr(config, "normalization", "LayerNorm"))


def model_forward_kwargs(config: Any, packed_seq_ids: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments for GPTModel.forward that carry the document map to the attention.

    The dense local spec gets no mask (causal over the whole row).
    """
    if is_msa_config(config):
        return {"attention_mask": packed_seq_ids}
    return {"attention_mask": None}


def configure(config: Any) -> None:
    """Attach the indexer-loss scale hook to the config (MSA only; a recipe's own wins)."""
    if not is_msa_config(config):
        return
    from nemo_msa.megatron.indexer_loss import MSAIndexerLossAutoScaler

    if getattr(config, "experimental_attention_variant_loss_scale_func", None) is None:
        config.experimental_attention_variant_loss_scale_func = (
            MSAIndexerLossAutoScaler.set_loss_scale
        )


def dense_warmup_steps(config: Any) -> int:
    """The number of dense warm-up iterations (0 without MSA)."""
    if not is_msa_config(config):
        return 0
    return int(getattr(config, "msa_dense_warmup_steps", 0) or 0)


def set_training_phase(config: Any, iteration: int) -> str:
    """Tell the MSA layers the iteration about to run (0-based); return its phase for the log.

    Returns:
        "dense-warmup" or "sparse"; "dense-gpt" without MSA.
    """
    if not is_msa_config(config):
        return "dense-gpt"
    from nemo_msa.megatron.phase import dense_warmup_active, set_training_iteration

    set_training_iteration(iteration)
    return "dense-warmup" if dense_warmup_active(config) else "sparse"


def indexer_param_ids(model_chunks: list) -> set[int]:
    """ids of the indexer parameters of all chunks (empty without MSA)."""
    try:
        from nemo_msa.megatron.phase import indexer_parameters
    except ImportError:
        return set()
    return {id(p) for p in indexer_parameters(model_chunks)}


def pop_step_metrics(config: Any) -> dict[str, float]:
    """Indexer loss and selection recall of the last step, reduced over all ranks (collective).

    Returns:
        ``{"indexer_loss": ..., "recall": ...}`` (recall only when the layers recorded it);
        empty without MSA.
    """
    if not is_msa_config(config):
        return {}
    from nemo_msa.megatron.indexer_loss import MSAIndexerMetrics

    raw = MSAIndexerMetrics.pop(num_layers=config.num_layers)
    out = {}
    if "indexer_loss" in raw:
        out["indexer_loss"] = raw["indexer_loss"]
    if "selection_recall" in raw:
        out["recall"] = raw["selection_recall"]
    return out


def layout_builds() -> int:
    """MSA layouts built so far in this process (memo hits excluded); 0 without MSA."""
    try:
        from nemo_msa import MSAMicrobatch
    except ImportError:
        return 0
    return MSAMicrobatch.num_builds()
