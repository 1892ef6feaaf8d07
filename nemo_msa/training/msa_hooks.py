"""Adapters between the training loop and the MSA Megatron modules (nemo_msa.megatron).

The loop needs six things from the MSA layers, and this module is the only place that knows
how the Megatron integration provides them. Whether a config is MSA is decided once
(:func:`hooks_for`); the loop keeps the returned :class:`TrainingHooks` (``TrainingObjects.hooks``):

- the decoder spec of a model chunk (``nemo_msa.megatron.layer_specs``), and the spec of
  Megatron's multi-token-prediction block when ``mtp_num_layers`` is set (``mtp_block_spec``);
- how a microbatch's document map reaches the attention: ``packed_seq_ids`` is passed to
  ``GPTModel.forward`` as ``attention_mask`` (source 2 of the contract), which Megatron hands
  unchanged to every layer (``model_forward_kwargs``); THD microbatches pass
  ``packed_seq_params`` instead (``forward_arguments``, every argument of the forward);
- the dense warm-up switch, set before each step (``set_training_phase``), and which
  optimizer parameters are the indexer's, so that only the indexer learns in the warm-up
  (``indexer_param_ids``);
- the indexer loss and selection recall of the last step, and the MTP loss
  (``pop_step_metrics``).

The indexer-loss scale hook that Megatron's schedules call per microbatch is installed by
``MSATransformerConfig`` itself. A model section without MSA fields (Megatron's plain
TransformerConfig) trains a dense GPT with Megatron's local spec (:class:`DenseGPTHooks`, which
does nothing MSA); the tests use that as a reference.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper


def is_msa_config(config: Any) -> bool:
    """Whether the model config is the MSA config (so the MSA spec and hooks apply)."""
    try:
        from nemo_msa.megatron.config import MSATransformerConfig
    except ImportError:
        return False
    return isinstance(config, MSATransformerConfig)


def hooks_for(config: Any) -> TrainingHooks:
    """The hooks of ``config``: :class:`MSAHooks` for the MSA config, else
    :class:`DenseGPTHooks` (decided here, once per run)."""
    return MSAHooks(config) if is_msa_config(config) else DenseGPTHooks(config)


class DenseGPTHooks:
    """A dense GPT with Megatron's own spec: no document map, no MSA phase or metrics.

    Args:
        config: Megatron's TransformerConfig.
    """

    #: Whether the layers are MSA.
    msa = False
    #: The number of dense warm-up iterations.
    dense_warmup_steps = 0

    def __init__(self, config: Any) -> None:
        self.config = config
        # Megatron's MTP tracker is process-wide; a run starts from an empty one (an earlier
        # run in this process may have had another number of depths).
        MTPLossLoggingHelper.tracker.clear()

    def layer_spec(self, vp_stage: int | None, pp_rank: int | None):
        """The decoder spec of one model chunk (Megatron's TE or local GPT layer spec)."""
        del vp_stage, pp_rank
        if getattr(self.config, "transformer_impl", "local") == "transformer_engine":
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            return get_gpt_layer_with_transformer_engine_spec()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(
            normalization=getattr(self.config, "normalization", "LayerNorm"))

    def mtp_block_spec(self, vp_stage: int | None, pp_rank: int | None):
        """Megatron's MTP block spec of one model chunk (its GPT layer as the MTP layer), or
        None without ``mtp_num_layers`` or off the stage that holds it."""
        if not getattr(self.config, "mtp_num_layers", None):
            return None
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        te = getattr(self.config, "transformer_impl", "local") == "transformer_engine"
        return get_gpt_mtp_block_spec(self.config, self.layer_spec(vp_stage, pp_rank), te,
                                      vp_stage=vp_stage, pp_rank=pp_rank)

    def model_forward_kwargs(self, packed_seq_ids: torch.Tensor) -> dict[str, Any]:
        """GPTModel.forward keywords: no mask (causal over the whole row)."""
        del packed_seq_ids
        return {"attention_mask": None}

    def forward_arguments(self, mb: Any, *, labels: bool = True) -> dict[str, Any]:
        """Every GPTModel.forward argument of one microbatch (a
        :class:`nemo_msa.training.data.Microbatch`).

        Document-id (BSHD) microbatches pass their [b, s] tensors and
        :meth:`model_forward_kwargs`; THD ones (``mb.packed_seq_params``) the rows end to end,
        [1, b * s], with ``packed_seq_params`` and no mask. ``loss_mask`` goes along for the
        MTP loss (Megatron reads it only there).

        Raises:
            ValueError: THD input to a model without MSA layers (the recipe refuses it first).
        """
        thd = getattr(mb, "packed_seq_params", None) is not None
        if thd and not self.msa:
            raise ValueError("THD microbatches (dataset.packed_format='thd') need MSA layers; "
                             "Megatron's local attention takes [b, s] rows")

        def shaped(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(1, -1) if thd else x

        args = {"input_ids": shaped(mb.tokens), "position_ids": shaped(mb.position_ids),
                "labels": shaped(mb.labels) if labels else None,
                "loss_mask": shaped(mb.loss_mask)}
        if thd:
            args.update(attention_mask=None, packed_seq_params=mb.packed_seq_params)
        else:
            args.update(self.model_forward_kwargs(mb.packed_seq_ids))
        return args

    def set_training_phase(self, iteration: int) -> str:
        """The phase of the iteration about to run, for the log."""
        del iteration
        return "dense-gpt"

    def pop_step_metrics(self, num_microbatches: int = 1,
                         device: torch.device | None = None) -> dict[str, float]:
        """The MTP loss of the last step (empty without MTP); collective.

        Args:
            num_microbatches: microbatches per step on a rank.
            device: where the reduction runs (the process group's device).
        """
        return pop_mtp_metrics(self.config, num_microbatches, device)

    def layout_builds(self) -> int | None:
        """MSA layouts built so far in this process: None (no MSA)."""
        return None


class MSAHooks(DenseGPTHooks):
    """The MSA layers (nemo_msa.megatron): their spec, document map, phase and metrics.

    Args:
        config: the MSATransformerConfig.
    """

    msa = True

    def __init__(self, config: Any) -> None:
        from nemo_msa.megatron.indexer_loss import MSAIndexerLossAutoScaler, MSAIndexerMetrics

        super().__init__(config)
        self.dense_warmup_steps = int(getattr(config, "msa_dense_warmup_steps", 0) or 0)
        # The indexer's metrics and loss scale are process-wide too: what an earlier run or
        # model in this process recorded and never popped (a failed step, a forward outside the
        # trainer) would otherwise be logged as this run's first step.
        MSAIndexerMetrics.reset()
        MSAIndexerLossAutoScaler.reset()

    def layer_spec(self, vp_stage: int | None, pp_rank: int | None):
        """The MSA decoder spec of one model chunk."""
        from nemo_msa.megatron.layer_specs import get_msa_decoder_block_spec

        return get_msa_decoder_block_spec(self.config, vp_stage=vp_stage, pp_rank=pp_rank)

    def mtp_block_spec(self, vp_stage: int | None, pp_rank: int | None):
        """The MTP block with MSA layers (:func:`nemo_msa.megatron.layer_specs.
        get_msa_mtp_block_spec`), or None without ``mtp_num_layers`` or off its stage."""
        from nemo_msa.megatron.layer_specs import get_msa_mtp_block_spec

        return get_msa_mtp_block_spec(self.config, vp_stage=vp_stage, pp_rank=pp_rank)

    def model_forward_kwargs(self, packed_seq_ids: torch.Tensor) -> dict[str, Any]:
        """GPTModel.forward keywords: ``packed_seq_ids`` as ``attention_mask`` (source 2 of the
        contract), which Megatron hands unchanged to every layer."""
        return {"attention_mask": packed_seq_ids}

    def set_training_phase(self, iteration: int) -> str:
        """Tell the MSA layers the iteration about to run (0-based).

        Returns:
            "dense-warmup" or "sparse".
        """
        from nemo_msa.megatron.phase import dense_warmup_active, set_training_iteration

        set_training_iteration(iteration)
        return "dense-warmup" if dense_warmup_active(self.config) else "sparse"

    def pop_step_metrics(self, num_microbatches: int = 1,
                         device: torch.device | None = None) -> dict[str, float]:
        """Indexer loss and selection recall of the last step, reduced over all ranks, and the
        MTP loss (collective).

        Returns:
            ``{"indexer_loss": ..., "recall": ...}`` (recall only when the layers recorded it)
            and the MTP loss (:func:`pop_mtp_metrics`). The indexer loss is the mean over the
            MSA layers, MTP layers included (logged as layers after the decoder's).
        """
        from nemo_msa.megatron.indexer_loss import MSAIndexerMetrics

        out = super().pop_step_metrics(num_microbatches, device)
        layers = self.config.num_layers + (getattr(self.config, "mtp_num_layers", None) or 0)
        raw = MSAIndexerMetrics.pop(num_layers=layers)
        if "indexer_loss" in raw:
            out["indexer_loss"] = raw["indexer_loss"]
        if "selection_recall" in raw:
            out["recall"] = raw["selection_recall"]
        return out

    def layout_builds(self) -> int:
        """MSA layouts built so far in this process (memo hits excluded)."""
        from nemo_msa import MSAMicrobatch

        return MSAMicrobatch.num_builds()


#: Either kind of hooks.
TrainingHooks = DenseGPTHooks


def pop_mtp_metrics(config: Any, num_microbatches: int,
                    device: torch.device | None = None) -> dict[str, float]:
    """The last step's MTP loss from Megatron's ``MTPLossLoggingHelper``, then reset; collective
    over the world when the model has MTP layers (every rank calls it).

    Megatron records, per depth and microbatch, the cross entropy of the MTP prediction averaged
    over the microbatch's positions that have a target (the mask rolled with the labels). Here
    it is averaged over the microbatches and over the ranks that hold the MTP layers
    (data- and context-parallel; tensor-parallel copies count once), as Megatron-LM's
    ``track_mtp_metrics`` reports ``mtp_<k> loss`` (without ``mtp_loss_scaling_factor``).

    Args:
        config: the model's TransformerConfig (``mtp_num_layers``).
        num_microbatches: microbatches per step on a rank.
        device: where the reduction runs (the process group's device; None: the CPU).

    Returns:
        ``{"mtp_loss": mean over depths, "mtp_loss/depth_<k>": ...}`` (per depth only with more
        than one); empty without MTP.
    """
    depths = getattr(config, "mtp_num_layers", None)
    if not depths:
        return {}
    tracker = MTPLossLoggingHelper.tracker
    buf = torch.zeros(depths + 1, dtype=torch.float64, device=device)
    values = tracker.get("loss_values")
    if values is not None and ps.get_tensor_model_parallel_rank() == 0:
        buf[:depths] = values.detach().to(buf)
        buf[depths] = 1.0
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(buf)
    owners = float(buf[depths])
    if owners == 0:
        return {}
    per_depth = (buf[:depths] / (owners * max(num_microbatches, 1))).tolist()
    out = {"mtp_loss": sum(per_depth) / depths}
    if depths > 1:
        out.update({f"mtp_loss/depth_{k + 1}": v for k, v in enumerate(per_depth)})
    return out


def indexer_param_ids(model_chunks: list) -> set[int]:
    """ids of the indexer parameters of all chunks (empty without MSA)."""
    try:
        from nemo_msa.megatron.phase import indexer_parameters
    except ImportError:
        return set()
    return {id(p) for p in indexer_parameters(model_chunks)}
