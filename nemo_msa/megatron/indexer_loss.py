"""How the indexer loss meets Megatron: its autograd scaler and its logged metrics.

The loss itself (reference, by-product and fused dense paths) lives in :mod:`nemo_msa.indexer_loss`.
It is attached to the attention output with :class:`MSAIndexerLossAutoScaler` (identity in the
forward; in the backward it injects ``d loss = scale``), so Megatron's pipeline schedules
back-propagate it with the main loss. The schedules set the scale through
``config.experimental_attention_variant_loss_scale_func`` (``MSATransformerConfig`` points it at
:meth:`MSAIndexerLossAutoScaler.set_loss_scale`), exactly as for DSA.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

__all__ = ["MSAIndexerLossAutoScaler", "MSAIndexerMetrics", "collective_device"]


class MSAIndexerLossAutoScaler(torch.autograd.Function):
    """Attaches the indexer loss to an activation: identity forward, ``d loss = scale`` backward.

    ``main_loss_backward_scale`` is what Megatron's schedules set per microbatch (the loss scale
    divided by the number of microbatches) through ``set_loss_scale``; it is 1 until then, which
    is right for a loop that calls ``loss.backward()`` on one microbatch itself.
    """

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, indexer_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indexer_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indexer_loss,) = ctx.saved_tensors
        scale = MSAIndexerLossAutoScaler.main_loss_backward_scale
        if scale is None:
            grad_loss = torch.ones_like(indexer_loss)
        else:
            grad_loss = torch.ones_like(indexer_loss) * scale.to(indexer_loss.device)
        return grad_output, grad_loss

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Sets the backward scale of every attached indexer loss (called by the schedules).

        Args:
            scale: scalar tensor.

        Raises:
            TypeError: ``scale`` is not a tensor.
        """
        if not isinstance(scale, torch.Tensor):
            raise TypeError(
                f"MSAIndexerLossAutoScaler.set_loss_scale needs a torch.Tensor; got {type(scale)}"
            )
        scale = scale.detach().float()
        if MSAIndexerLossAutoScaler.main_loss_backward_scale is None:
            MSAIndexerLossAutoScaler.main_loss_backward_scale = scale.clone()
        else:
            MSAIndexerLossAutoScaler.main_loss_backward_scale.copy_(scale)

    @staticmethod
    def reset() -> None:
        """Forgets the scale (back to 1)."""
        MSAIndexerLossAutoScaler.main_loss_backward_scale = None


class MSAIndexerMetrics:
    """Per-layer accumulator of the indexer loss and the selection recall, for logging.

    Layers record every training microbatch; :meth:`pop` reduces over tensor-, context-,
    pipeline- and data-parallel ranks and resets. Process-wide like Megatron's DSA/MoE loss
    trackers. Under context parallelism each rank records its share of a microbatch (the KL of
    its local queries normalised by the microbatch's global token count, the recall mass and
    count of its local queries), so shares add up over the CP group as over the TP group.
    Selection recall = mean over (token, KV head) of the main attention's block mass that the
    selected blocks cover (1.0 means the sparse layer sees everything dense attention would
    weigh).
    """

    # layer_number -> fp32 [4]: kl (TP-partial), recall mass (TP-partial), recall count
    # (TP-partial), microbatches (same on every TP rank).
    _values: dict[int, torch.Tensor] = {}

    @classmethod
    def record(cls, layer_number: int, stats: dict[str, torch.Tensor]) -> None:
        """Adds one microbatch of one layer."""
        kl = stats["kl"].detach().float()
        row = torch.stack(
            [
                kl,
                stats.get("recall_mass", torch.zeros_like(kl)).float(),
                stats.get("recall_count", torch.zeros_like(kl)).float(),
                torch.ones_like(kl),
            ]
        )
        if layer_number in cls._values:
            cls._values[layer_number] += row
        else:
            cls._values[layer_number] = row

    @classmethod
    def reset(cls) -> None:
        """Drops everything recorded."""
        cls._values = {}

    @classmethod
    def pop(cls, num_layers: int | None = None, reduce: bool = True) -> dict[str, float]:
        """Reduced metrics of everything recorded since the last pop, then reset.

        Every rank of the model must call it (it runs collectives when ``reduce`` and
        torch.distributed is initialized).

        Args:
            num_layers: total layers of the model (default: the largest recorded layer number,
                which must then be the same on all ranks; pass it with pipelining).
            reduce: all-reduce over TP and CP (sum of shares), PP (layers live on one stage)
                and DP (average).

        Returns:
            ``{"indexer_loss": mean KL over MSA layers and microbatches (without the
            coefficient), "selection_recall": mean recall, "indexer_loss/layer_<n>": ...,
            "selection_recall/layer_<n>": ...}``; empty when no rank recorded anything.
        """
        values = cls._values
        cls._values = {}
        if num_layers is None:
            num_layers = max(values) if values else 0
        collective = (reduce and torch.distributed.is_available()
                      and torch.distributed.is_initialized())
        if collective:
            # The table lives where the process group's backend reduces: a rank without MSA
            # layers (or a dense-only model) has no recorded tensor to take the device from.
            device = collective_device()
        else:
            device = next(iter(values.values())).device if values else torch.device("cpu")
        table = torch.zeros(num_layers, 4, dtype=torch.float32, device=device)
        for layer_number, row in values.items():
            table[layer_number - 1] += row.to(device)
        if collective:
            table = _reduce_table(table)
        present = table[:, 3] > 0
        if not bool(present.any()):
            return {}
        micro = table[:, 3].clamp_min(1.0)
        kl = table[:, 0] / micro
        recall = table[:, 1] / table[:, 2].clamp_min(1.0)
        has_recall = present & (table[:, 2] > 0)
        out = {"indexer_loss": float(kl[present].mean())}
        if bool(has_recall.any()):
            out["selection_recall"] = float(recall[has_recall].mean())
        for index in torch.nonzero(present).flatten().tolist():
            out[f"indexer_loss/layer_{index + 1}"] = float(kl[index])
            if bool(has_recall[index]):
                out[f"selection_recall/layer_{index + 1}"] = float(recall[index])
        return out


def collective_device(group=None) -> torch.device:
    """The device a tensor must be on to be all-reduced over ``group`` (default: the world).

    NCCL reduces CUDA tensors only (a CPU tensor fails with "No backend type associated with
    device type cpu"); gloo reduces CPU tensors. A group with both backends takes CUDA.

    Args:
        group: a process group, or None for the default group.

    Returns:
        ``cuda:<current device>`` when the group's backend includes NCCL, else ``cpu``.
    """
    backend = str(torch.distributed.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce_table(table: torch.Tensor) -> torch.Tensor:
    if not parallel_state.model_parallel_is_initialized():
        return table
    dist = torch.distributed
    shares, micro = table[:, :3].contiguous(), table[:, 3:].contiguous()
    # TP and CP ranks each hold a share of the same microbatches of a layer (a CP rank records
    # its own queries' KL divided by the global token count and its own tokens' recall): the
    # shares add up, the microbatch count is the same on all of them.
    for group in (parallel_state.get_tensor_model_parallel_group(),
                  parallel_state.get_context_parallel_group(check_initialized=False)):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(shares, group=group)
            dist.all_reduce(micro, op=dist.ReduceOp.MAX, group=group)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    dist.all_reduce(shares, group=pp_group)
    dist.all_reduce(micro, group=pp_group)
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False)
    if dist.get_world_size(dp_group) > 1:
        # Average the per-layer ratios' ingredients across data-parallel replicas.
        dist.all_reduce(shares, group=dp_group)
        dist.all_reduce(micro, group=dp_group)
    return torch.cat([shares, micro], dim=1)
