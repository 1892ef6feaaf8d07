"""RMSNorm for the local (Megatron-Core-only) spec, honouring ``layernorm_zero_centered_gamma``.

Megatron's local norm (``WrappedTorchNorm``, i.e. ``torch.nn.RMSNorm``) refuses
``layernorm_zero_centered_gamma=True``; only Transformer Engine's ``TENorm`` has it. MiniMax-M3
stores every norm weight zero-centred (Gemma style, applied as ``1 + weight``), so the local spec
of an M3 model builds :class:`RMSNorm` instead, and the MSA indexer's q/k norms use it in both
implementations (they are replicated over tensor parallelism and need their own gradient
reduction, which TE's norm does not do).

    zero_centered_gamma=True:  y = x * rsqrt(mean(x^2) + eps) * (1 + weight), weight init 0
    zero_centered_gamma=False: y = x * rsqrt(mean(x^2) + eps) * weight,       weight init 1

computed in float32 (float64 stays float64) and returned in x's dtype.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size, get_tensor_model_parallel_group_if_none

from nemo_msa.backends.capabilities import TRITON_HELPERS
from nemo_msa.triton.kernel_layout import kernels_run_on
from nemo_msa.triton.rms_norm import rms_norm_backward_triton, rms_norm_forward_triton

__all__ = ["GemmaRMSNorm", "RMSNorm", "planned_norm"]


def _param_device(config: TransformerConfig) -> torch.device | None:
    # None: torch's default device (the CPU, or "meta" inside ``with torch.device("meta")``).
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


class RMSNorm(MegatronModule):
    """RMSNorm over the last dim whose weight convention follows the config.

    Built by Megatron as ``build_module(spec, config=..., hidden_size=..., eps=...)`` (the
    ``LayerNormBuilder`` protocol), so it stands wherever the local spec puts a norm.

    Args:
        config: the model config; ``layernorm_zero_centered_gamma`` picks the convention unless
            ``zero_centered_gamma`` is given.
        hidden_size: normalized channels.
        eps: added to the mean square.
        tp_group: the tensor-parallel group (default: Megatron's); the weight is replicated on it.
        sum_grad_across_tp: sum the weight's gradient over ``tp_group`` inside autograd (for a
            replicated weight applied to rank-local heads, as the index q norm is).
        zero_centered_gamma: override of ``config.layernorm_zero_centered_gamma``.
        fused: run the one-kernel RMSNorm (:mod:`nemo_msa.triton.rms_norm`, the same function)
            instead of torch's. An MSA layer builds its own norms with its plan's
            :attr:`~nemo_msa.plan.MSAKernels.rms_norm` (:func:`planned_norm`); the block's other
            norms (no plan) run torch's, which is one fused kernel each way on CUDA.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        tp_group: torch.distributed.ProcessGroup | None = None,
        sum_grad_across_tp: bool = False,
        zero_centered_gamma: bool | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__(config=config)
        if zero_centered_gamma is None:
            zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.fused = bool(fused)
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(
            init(hidden_size, dtype=config.params_dtype, device=_param_device(config))
        )
        if tp_group is None:
            tp_group = get_tensor_model_parallel_group_if_none(None)
        # Also what MegatronModule.sharded_state_dict uses for the replica ids of the weight.
        self.tp_group = tp_group
        self._sum_grad = sum_grad_across_tp and get_pg_size(tp_group) > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes ``x [..., hidden_size]`` (any float dtype); returns x's dtype and shape."""
        weight = self.weight
        if self._sum_grad:
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        if self.fused:
            _check_kernel_input(x)
            return _RMSNormKernel.apply(x, weight, self.eps, self.zero_centered_gamma)
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        scale = weight.to(compute)
        if self.zero_centered_gamma:
            scale = 1.0 + scale
        # torch's fused RMSNorm (one kernel each way on CUDA): the same arithmetic as
        # x * rsqrt(mean(x^2) + eps) * scale in ``compute``, in fewer passes (issue #28).
        return F.rms_norm(x.to(compute), (self.hidden_size,), scale, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}, fused={self.fused}")


def _check_kernel_input(x: torch.Tensor) -> None:
    """Refuses an input the one-kernel RMSNorm does not take (its record,
    :data:`~nemo_msa.backends.capabilities.TRITON_HELPERS`' ``rms_norm``: fp16/bf16 rows of a
    power-of-two width up to 256, on CUDA or under the interpreter), which the plan that chose
    it did not foresee. The kernel computes torch's fp32 arithmetic, rounded once (the mean
    square is summed in another order: the last fp32 bit of 1/rms may differ).

    Raises:
        ValueError: naming ``MSAKernels.rms_norm``.
    """
    reason = TRITON_HELPERS.rms_norm.why_not(dtype=x.dtype, dim=x.shape[-1])
    if reason is None and not kernels_run_on(x):
        reason = f"the Triton kernels do not run on {x.device}"
    if reason is not None:
        raise ValueError(f"MSAKernels.rms_norm=True but {reason}; the layer's plan did not "
                         "foresee this input")


def planned_norm(spec, fused: bool):
    """A norm spec (a class or ``ModuleSpec``) that builds :class:`RMSNorm` with ``fused`` (a
    layer's plan's :attr:`~nemo_msa.plan.MSAKernels.rms_norm`), so the layer decides for its
    norms when they are built; any other norm (Megatron's, TE's, ``IdentityOp``) as it is."""
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if not (isinstance(module, type) and issubclass(module, RMSNorm)):
        return spec
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, params={**spec.params, "fused": fused})
    return ModuleSpec(module=module, params={"fused": fused})


class _RMSNormKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, centered):
        y, rstd = rms_norm_forward_triton(x, weight, eps, centered)
        ctx.save_for_backward(x, weight, rstd)
        ctx.centered = centered
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward_triton(grad, x, weight, rstd, ctx.centered)
        return dx, dw.to(weight.dtype), None, None


class GemmaRMSNorm(RMSNorm):
    """:class:`RMSNorm` with ``zero_centered_gamma=True`` whatever the config says."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        tp_group: torch.distributed.ProcessGroup | None = None,
        sum_grad_across_tp: bool = False,
        fused: bool = False,
    ) -> None:
        super().__init__(config, hidden_size, eps, tp_group, sum_grad_across_tp,
                         zero_centered_gamma=True, fused=fused)
