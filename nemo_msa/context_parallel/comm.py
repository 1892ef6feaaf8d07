"""The one collective of context parallelism: a differentiable all-gather of K, V and index_k.

Forward: all-gather every rank's local rows over the CP group and put them in the global
sequence order. Backward: the gradient of the gathered tensor is put back in rank order and
reduce-scattered (summed) to the owners, so every rank's local K, V and index_k receive the
contributions of every rank's queries (the gradient of index_k included: Megatron issue #5643 is
an indexer left with zero gradient under CP). NCCL uses ``all_gather_into_tensor`` /
``reduce_scatter_tensor``; gloo, which has no reduce-scatter, an all-reduce and a slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_from_context_parallel"]


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    if dist.get_backend(group) == "gloo":
        dist.all_gather(list(out.chunk(size)), x.contiguous(), group=group)
    else:
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if dist.get_backend(group) == "gloo":
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x.chunk(size)[dist.get_rank(group)].clone()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _GatherFromContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, order):
        ctx.group = group
        ctx.save_for_backward(order)
        gathered = _all_gather(x, group)  # [N * s_local, ...] in rank order
        return gathered.new_empty(gathered.shape).index_copy_(0, order, gathered)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return _reduce_scatter(grad.index_select(0, order), ctx.group), None, None


def gather_from_context_parallel(
    x_local: torch.Tensor, seq_dim: int, group, order: torch.Tensor
) -> torch.Tensor:
    """All-gather over the CP group into the global sequence order (differentiable).

    Args:
        x_local: [..., s_local, ...] this rank's rows along ``seq_dim`` (every rank the same
            shape), in its local order.
        seq_dim: the sequence dimension.
        group: the context-parallel process group (gloo or NCCL); size 1 returns ``x_local``.
        order: int64 [N * s_local] on x's device, the global index of each gathered row (rank 0's
            local indices, then rank 1's, ...: :func:`nemo_msa.context_parallel.gather_order`).

    Returns:
        [..., N * s_local, ...] in the global order. Its backward reduce-scatters (sums) the
        gradient back to each rank's local rows.

    Raises:
        ValueError: ``order`` does not have N * s_local entries.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x_local
    size = dist.get_world_size(group)
    moved = x_local.movedim(seq_dim, 0)
    if order.shape != (size * moved.shape[0],):
        raise ValueError(
            f"order has shape {tuple(order.shape)}; expected [{size} ranks x "
            f"{moved.shape[0]} local rows]"
        )
    return _GatherFromContextParallel.apply(moved, group, order).movedim(0, seq_dim)
