"""RoPE at per-token angles with its factors built once per layer call, in fewer kernels.

An MSA layer rotates four tensors at the same per-token angles: the attention's q and k and the
indexer's index_q and index_k. Megatron's unfused ``apply_rotary_pos_emb`` (bshd) computes
``cos``/``sin`` of the angles and casts them for every call, slices the rotated part off, negates
and concatenates a rotated half, and its autograd backward adds the slices' zero-filled
gradients: about 12 kernels forward and 10 backward per tensor on the GPU (issue #28's
profile). :func:`rope_factors` builds ``cos`` and a sign-folded ``sin`` once per layer call and
dtype; :func:`apply_rope` applies them in one autograd function: one Triton kernel each way
for bf16 where the layer's plan names it (:attr:`nemo_msa.plan.MSAKernels.rope`,
:func:`nemo_msa.triton.rope.rope_triton`), else 4-5 torch kernels.

``config.apply_rope_fusion`` (ADR 0054; the plan's :attr:`~nemo_msa.plan.MSAKernels.te_rope`)
runs Transformer Engine's fused RoPE instead, through Megatron's ``fused_apply_rotary_pos_emb``
(TE's ``FusedRoPEFunc``, one kernel each way), at the same per-token angles: the compact tensor
[T, heads, dim] is TE's ``sbhd`` with s = T tokens and b = 1, and the angle rows [T, 1, 1, rot]
are those tokens' document positions, so every packed document restarts at 0 under any layout
(BSHD or THD input, context parallelism). TE computes in fp32 and rounds once, so its bf16
result differs from the unfused one by bf16 rounding, not more. :func:`check_rope_fusion` is the
construction gate: TE must import and the layer must run on a CUDA device.

The arithmetic is Megatron's, operation for operation, so the result is the same bits: with
``x = t[..., :rot]`` in halves ``x1, x2`` and ``c = cos(f).to(dtype)``, ``s = sin(f).to(dtype)``,
Megatron computes ``x * c + cat(-x2, x1) * s``; here ``x * c + cat(x2, x1) * cat(-s1, s2)``,
and ``(-a) * b == a * (-b)`` exactly in IEEE arithmetic. The backward is the transpose,
``g * c + swap(g * cat(-s1, s2))``, which is what autograd computes for Megatron's graph (the
two contributions added once; a sum is order-independent for two terms).
Interleaved RoPE (``config.rotary_interleaved``) keeps Megatron's function.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import (
    apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb,
)

from nemo_msa import unplanned
from nemo_msa.backends.capabilities import TRITON_HELPERS
from nemo_msa.triton.kernel_layout import kernels_run_on
from nemo_msa.triton.rope import rope_triton

__all__ = ["RopeFactors", "apply_rope", "check_rope_fusion", "rope_factors"]


class RopeFactors:
    """Per-token RoPE factors of one layer call: the angles and, per dtype, ``cos`` and the
    sign-folded ``sin``, built on first use.

    Args:
        freqs: fp32 [Tq, 1, rot_dim] per-token angles (``MSASelfAttention``'s table rows).
        interleaved: ``config.rotary_interleaved`` (then Megatron's function runs).
        fused: run the one-kernel RoPE (the layer passes its plan's
            :attr:`~nemo_msa.plan.MSAKernels.rope`; an input it does not take is then refused);
            None chooses per call from the device and the input (a direct caller, counted by
            :mod:`nemo_msa.unplanned`).
        te_fused: Transformer Engine's fused RoPE runs (the plan's
            :attr:`~nemo_msa.plan.MSAKernels.te_rope`, ``config.apply_rope_fusion``, checked
            when the layer is built, :func:`check_rope_fusion`).
    """

    def __init__(
        self, freqs: torch.Tensor, interleaved: bool, fused: bool | None = None,
        te_fused: bool = False,
    ) -> None:
        if freqs.shape[-1] % 2:
            raise ValueError(f"rotary dim {freqs.shape[-1]} is odd; RoPE rotates halves")
        self.freqs = freqs
        self.interleaved = interleaved
        self.fused = fused
        self.te_fused = te_fused
        self._by_dtype: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_signed)`` [Tq, 1, rot_dim] in ``dtype``: ``cos(f)`` and
        ``cat(-sin(f)[..., :rot/2], sin(f)[..., rot/2:])``, each cast to ``dtype`` (as Megatron
        casts them)."""
        found = self._by_dtype.get(dtype)
        if found is None:
            cos = torch.cos(self.freqs).to(dtype)
            sin = torch.sin(self.freqs).to(dtype)
            half = sin.shape[-1] // 2
            sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            found = self._by_dtype[dtype] = (cos.contiguous(), sin_signed)
        return found


def rope_factors(
    freqs: torch.Tensor | None, config, fused: bool | None = None,
    te_fused: bool | None = None,
) -> RopeFactors | None:
    """The layer call's :class:`RopeFactors` of ``freqs`` (None for None); ``fused`` and
    ``te_fused`` as :class:`RopeFactors` takes them (the layer passes its plan's
    :attr:`~nemo_msa.plan.MSAKernels.rope` / ``te_rope``); ``te_fused`` None reads
    ``config.apply_rope_fusion`` (a direct caller, counted by :mod:`nemo_msa.unplanned`)."""
    if freqs is None:
        return None
    if te_fused is None:
        unplanned.record("te_rope")
        te_fused = bool(getattr(config, "apply_rope_fusion", False))
    return RopeFactors(freqs, bool(getattr(config, "rotary_interleaved", False)), fused,
                       te_fused=te_fused)


def check_rope_fusion(config, device: torch.device) -> None:
    """The construction gate of ``config.apply_rope_fusion`` for an MSA or dense-document layer.

    Args:
        config: the layer's config.
        device: where the layer runs (TE's fused RoPE is a CUDA kernel).

    Raises:
        ImportError: ``apply_rope_fusion=True`` where Transformer Engine's fused RoPE does not
            import.
        ValueError: ``apply_rope_fusion=True`` on a device other than CUDA.
    """
    if not getattr(config, "apply_rope_fusion", False):
        return
    if fused_apply_rotary_pos_emb is None:
        raise ImportError(
            "config.apply_rope_fusion=True needs Transformer Engine's fused RoPE "
            "(megatron.core.extensions.transformer_engine.fused_apply_rotary_pos_emb), which "
            "does not import here; install transformer-engine or set apply_rope_fusion=False"
        )
    if torch.device(device).type != "cuda":
        raise ValueError(
            f"config.apply_rope_fusion=True on device {torch.device(device).type!r}: Transformer "
            "Engine's fused RoPE is a CUDA kernel; set apply_rope_fusion=False off the GPU"
        )


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1)


def _kernel_runs(t: torch.Tensor, cos: torch.Tensor, fused: bool | None) -> bool:
    """Whether the one-kernel RoPE (:func:`nemo_msa.triton.rope.rope_triton`) runs: where
    ``fused`` says so (None: on CUDA or the host under the interpreter, where it takes the
    input). It takes [T, H, dim] in the dtypes of its record
    (:data:`~nemo_msa.backends.capabilities.TRITON_HELPERS`' ``rope``: bf16; fp16 keeps the
    torch ops, whose bits its compiled fp16 results missed by one unit in the last place on an
    H200, 2026-12-04, benchmarks/results/2026-12-04-h200-layer-rows-ff484f3.md, and bit equality
    is its contract) with [T, 1, rot] factors, and computes the same bits as the torch ops.

    Raises:
        ValueError: ``fused`` on an input the kernel does not take, naming
            ``MSAKernels.rope``.
    """
    takes = (TRITON_HELPERS.rope.why_not(dtype=t.dtype) is None and t.dim() == 3
             and cos.dim() == 3 and cos.shape[0] == t.shape[0] and cos.shape[1] == 1)
    if fused is None:
        unplanned.record("rope")
        return kernels_run_on(t) and takes
    if fused and not (takes and kernels_run_on(t)):
        raise ValueError(f"MSAKernels.rope=True but the one-kernel RoPE does not take "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}; the layer's plan did not "
                         "foresee this input")
    return fused


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin_signed, fused):
        ctx.save_for_backward(cos, sin_signed)
        ctx.fused = fused
        if _kernel_runs(t, cos, fused):
            return rope_triton(t, cos, sin_signed)
        rot = cos.shape[-1]
        x = t[..., :rot]
        y = x * cos + _swap_halves(x) * sin_signed
        return torch.cat((y, t[..., rot:]), dim=-1) if rot < t.shape[-1] else y

    @staticmethod
    def backward(ctx, grad):
        cos, sin_signed = ctx.saved_tensors
        if _kernel_runs(grad, cos, ctx.fused):
            return rope_triton(grad, cos, sin_signed, backward=True), None, None, None
        rot = cos.shape[-1]
        g = grad[..., :rot]
        dx = g * cos + _swap_halves(g * sin_signed)
        dt = torch.cat((dx, grad[..., rot:]), dim=-1) if rot < grad.shape[-1] else dx
        return dt, None, None, None


def apply_rope(t: torch.Tensor, factors: RopeFactors, config, cp_group=None) -> torch.Tensor:
    """Rotates the first ``rot_dim`` channels of ``t`` at its tokens' angles.

    Args:
        t: [Tq, heads, dim] (dim >= rot_dim), any float dtype.
        factors: the layer call's :class:`RopeFactors` (angles of t's tokens).
        config: the layer's config (Megatron's fallback reads it).
        cp_group: passed to Megatron's fallback.

    Returns:
        [Tq, heads, dim] in t's dtype: Megatron's ``apply_rotary_pos_emb(t, freqs)`` (bshd,
        unfused), the same bits; with ``factors.te_fused`` TE's fused RoPE at the same angles
        (fp32 arithmetic, one rounding).
    """
    if factors.te_fused:
        # TE's sbhd with s = tokens, b = 1: row i of t at angle row i (its document position).
        rotated = fused_apply_rotary_pos_emb(
            t.unsqueeze(1), factors.freqs.view(t.shape[0], 1, 1, -1),
            interleaved=factors.interleaved,
        )
        return rotated.squeeze(1)
    if factors.interleaved:
        # Megatron's bshd function indexes [s, b, h, d] and takes [s, 1, 1, d] angles: b = 1,
        # as on TE's path.
        rotated = apply_rotary_pos_emb(t.unsqueeze(1), factors.freqs.view(t.shape[0], 1, 1, -1),
                                       config=config, cp_group=cp_group)
        return rotated.squeeze(1)
    cos, sin_signed = factors.tables(t.dtype)
    return _Rope.apply(t, cos, sin_signed, factors.fused)
