"""One resolved plan per MSA layer: what runs, decided once when the layer is built (ADR 0019,
ADR 0048).

:meth:`MSAPlan.build` is the construction gate: the config's refusals and topology
(:func:`nemo_msa.support.require_msa_support`), the backend for the device (the registry, with
``NEMO_MSA_BACKEND`` read here and nowhere later), the backend's capability record asked for the
layer's shape and dtype, and the kernels the layer runs (:class:`MSAKernels`: the forward, the
dk/dv kernel, each helper around the ops, the indexer loss's route). The layer keeps the plan
and passes it to the ops and helpers, which read their field of it; a call the plan did not
foresee is refused, naming the field, rather than run on another kernel. The choice itself is
:func:`choose_kernels`, a function of its arguments (the device's compute capability among
them), so that the choices of GPUs this machine lacks are tested on the CPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from nemo_msa.backends.capabilities import GLUON_DKDV, MSACapabilities
from nemo_msa.backends.registry import resolve_backend
from nemo_msa.backends.spec import MSABackend
from nemo_msa.support import (
    DEFAULT_INDEXER_LOSS_COEFF,
    DEFAULT_INDEXER_LOSS_TYPE,
    MSATopology,
    require_msa_support,
)
from nemo_msa.triton.kernel_layout import INTERPRET
from nemo_msa.triton.launch import current_launch

__all__ = ["MSAKernels", "MSAPlan", "choose_kernels", "params_dtype"]

#: The indexer loss's routes (:attr:`MSAPlan.loss_route`).
LossRoute = Literal["byproducts", "fused_dense", "reference_sparse", "reference_dense"]


def params_dtype(config: Any) -> torch.dtype:
    """The dtype a Megatron config trains its parameters in (bf16, fp16, else fp32)."""
    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    return torch.float32


@dataclass(frozen=True)
class MSAKernels:
    """The kernels one MSA layer runs, named once by its plan. The code that runs each reads
    its field; a call the plan did not foresee (another dtype or shape) is refused, naming the
    field, never run on another kernel.

    Attributes:
        forward: the sparse forward where no block mass is asked (evaluation, the dense loss,
            a step with the loss off): ``"reference"``, ``"triton"`` or ``"flashinfer"``.
        mass_forward: the sparse forward where the block mass is asked (a training step of the
            sparse loss from the by-products): ``"reference"`` or ``"triton"``.
        dkdv: the backward's dk/dv kernel: ``"reference"``, ``"triton"`` or ``"gluon"`` (SM90,
            :data:`~nemo_msa.backends.capabilities.GLUON_DKDV`).
        rms_norm: the layer's own RMSNorms (index q/k, and q/k where the spec builds
            :class:`nemo_msa.megatron.norms.RMSNorm`) run the one-kernel RMSNorm.
        rope: RoPE of q, k, index_q and index_k runs the one-kernel RoPE.
        te_rope: RoPE of q, k, index_q and index_k runs Transformer Engine's fused RoPE at the
            tokens' document positions (``config.apply_rope_fusion``, ADR 0054; the layer's
            construction gate checks that it imports and that the layer is on CUDA); it takes
            precedence over ``rope``.
        loss_passes: the sparse loss's passes over the selected slots run in Triton.
        recall: the sampled selection recall runs the Triton kernel.
        dense_attention: the dense path (dense layers, the warm-up): ``"per_document"``
            (cuDNN SDPA per run of equal-length documents), ``"rows"`` (per-row SDPA with a
            document mask) or ``"queries"`` (a query subset: context parallelism).
    """

    forward: str
    mass_forward: str
    dkdv: str
    rms_norm: bool = False
    rope: bool = False
    te_rope: bool = False
    loss_passes: bool = False
    recall: bool = False
    dense_attention: str = "rows"


def choose_kernels(
    capabilities: MSACapabilities,
    preferred_forward: MSACapabilities | None,
    topology: MSATopology,
    *,
    dtype: torch.dtype,
    cp_size: int,
    cuda: bool,
    interpreter: bool,
    compute_capability: tuple[int, int] | None,
    dkdv_requested: str = "gluon",
    triton_version: str = "",
) -> MSAKernels:
    """The kernels of a layer: a function of its arguments only (no device is asked).

    Args:
        capabilities: the backend's record (:attr:`MSABackend.capabilities`).
        preferred_forward: the record of the forward the backend prefers where it runs the
            call (:attr:`MSABackend.preferred_forward`), or None.
        topology: the layer's shape.
        dtype: the parameter dtype.
        cp_size: the context-parallel size (above 1 the ops run a query subset).
        cuda: the layer runs on a CUDA device.
        interpreter: Triton's interpreter runs the Triton kernels on the host.
        compute_capability: the CUDA device's (major, minor), None without one.
        dkdv_requested: the launch setting ``bwd.kv_kernel`` (``"triton"`` keeps the Triton
            dk/dv kernel where the Gluon one would run).
        triton_version: the installed Triton's version ("" without Triton).

    Returns:
        The kernels.
    """
    group = topology.num_heads // topology.num_kv_heads
    base = capabilities.key
    forward = mass_forward = base
    if preferred_forward is not None and preferred_forward.why_not(
            dtype=dtype, head_dim=topology.head_dim, block_size=topology.block_size,
            top_k=topology.top_k, group=group, cp_size=cp_size) is None:
        forward = preferred_forward.key
        if preferred_forward.block_mass:
            mass_forward = forward
    dkdv = base
    if capabilities.gluon_dkdv and dkdv_requested == "gluon" and GLUON_DKDV.why_not(
            compute_capability=compute_capability, dtype=dtype, head_dim=topology.head_dim,
            block_size=topology.block_size, group=group, triton_version=triton_version) is None:
        dkdv = "gluon"
    helpers = capabilities.helpers
    # A Triton helper runs where the Triton kernels do (CUDA, or the host under the
    # interpreter); cuDNN's SDPA on CUDA only.
    runs = cuda or interpreter

    def takes(kernel, dim=None) -> bool:
        return (kernel is not None and runs
                and kernel.why_not(dtype=dtype, dim=dim, query_subset=cp_size > 1,
                                   cuda=cuda) is None)

    if cp_size > 1:
        dense = "queries"
    elif takes(helpers.dense_attention):
        dense = "per_document"
    else:
        dense = "rows"
    # The norms the plan decides are the index norms (index head dim) and the q/k norms (head
    # dim): the kernel runs where it takes both.
    norm = takes(helpers.rms_norm, topology.index_head_dim) and takes(helpers.rms_norm,
                                                                     topology.head_dim)
    return MSAKernels(
        forward=forward, mass_forward=mass_forward, dkdv=dkdv, rms_norm=norm,
        rope=takes(helpers.rope), loss_passes=takes(helpers.loss_passes,
                                                    topology.index_head_dim),
        recall=takes(helpers.recall, topology.head_dim), dense_attention=dense,
    )


def _compute_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


@functools.cache
def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return ""


@dataclass(frozen=True)
class MSAPlan:
    """What one MSA layer runs, resolved at construction.

    Attributes:
        topology: the validated topology (heads, dims, block size, top_k, forced blocks, score).
        backend: the resolved backend; the ops take it as it is.
        device: where the layer runs.
        dtype: the layer's parameter dtype (q/k/v and the indexer's).
        cp_size: the context-parallel group size the layer was built in.
        kernels: the kernels the layer runs (:class:`MSAKernels`).
        sparse_loss: ``msa_indexer_loss_type="sparse"``: past the dense warm-up the indexer
            loss is the KL over the selected blocks (else over every candidate block).
        loss_route: the indexer loss past the dense warm-up: ``"byproducts"`` (the sparse loss
            taking its target from the sparse forward's block mass: score ``"max"``, ADR 0016,
            0033), ``"fused_dense"`` (the dense loss in Triton, ADR 0018),
            ``"reference_sparse"`` or ``"reference_dense"`` (the chunked reference,
            :func:`nemo_msa.indexer_loss.compute_indexer_loss`, which recomputes its target).
        warmup_loss_route: the indexer loss during the dense warm-up (always the dense loss):
            ``"fused_dense"`` or ``"reference_dense"``.
        training_forward: the forward kernel a training step past the dense warm-up runs
            (:attr:`MSAKernels.mass_forward` where the loss asks for the block mass, else
            :attr:`MSAKernels.forward`): under the sparse indexer loss flashinfer's prefill
            serves evaluation only.
        dense_loss_reason: why the dense loss takes the reference (None when it runs fused).
    """

    topology: MSATopology
    backend: MSABackend
    device: torch.device
    dtype: torch.dtype
    kernels: MSAKernels
    cp_size: int = 1
    sparse_loss: bool = False
    loss_route: LossRoute = "reference_dense"
    warmup_loss_route: LossRoute = "reference_dense"
    training_forward: str = ""
    dense_loss_reason: str | None = None

    @property
    def loss_from_byproducts(self) -> bool:
        """The sparse indexer loss takes its target from the sparse forward's block mass."""
        return self.loss_route == "byproducts"

    @property
    def fused_dense_loss(self) -> bool:
        """The dense indexer loss (the dense warm-up, or ``msa_indexer_loss_type="dense"``)
        runs fused in Triton (:func:`nemo_msa.indexer_loss.dense_indexer_loss_triton`) rather
        than on the chunked reference (the same function; ADR 0018)."""
        return self.warmup_loss_route == "fused_dense"

    @classmethod
    def build(
        cls,
        config: Any,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        cp_size: int = 1,
        backend: str | None = None,
        compute_capability: tuple[int, int] | None = None,
    ) -> MSAPlan:
        """Resolves a layer's plan; every refusal names the config field.

        Args:
            config: a Megatron TransformerConfig with the ``msa_*`` fields (or any object with
                those names).
            device: where the layer will run.
            dtype: the parameter dtype (default: from ``config.bf16`` / ``config.fp16``).
            cp_size: the context-parallel group size (Megatron's process groups).
            backend: the requested backend (default ``config.msa_backend``); the environment
                variable ``NEMO_MSA_BACKEND`` overrides it (read here, once).
            compute_capability: the GPU's (major, minor) the kernels are chosen for; None reads
                the device's (none on the CPU). Given, it lets the CPU test what a GPU would
                run (the backend's device check is its own).

        Returns:
            The plan.

        Raises:
            NotImplementedError: a feature MSA does not run (FP8, fused single-QKV RoPE;
                :func:`~nemo_msa.support.require_msa_support`).
            ValueError: a topology MSA cannot run, or one the backend cannot (from its
                capability record, naming the field and its value: context parallelism with a
                backend that takes no query subset among them).
        """
        requested = backend if backend is not None else getattr(config, "msa_backend", None)
        topology = require_msa_support(config, requested)
        dtype = params_dtype(config) if dtype is None else dtype
        device = torch.device(device)
        # The one check of context parallelism: the config's size or the layer's process group;
        # above 1 the backend must take a query subset (``auto`` skips those that do not).
        cp_size = max(getattr(config, "context_parallel_size", 1) or 1, cp_size)
        chosen = resolve_backend(
            requested, device, score_type=topology.score_type, head_dim=topology.head_dim,
            index_head_dim=topology.index_head_dim, block_size=topology.block_size,
            top_k=topology.top_k, dtype=dtype, cp_size=cp_size,
        )
        caps = chosen.capabilities
        kernels = choose_kernels(
            caps, chosen.preferred_forward, topology, dtype=dtype, cp_size=cp_size,
            cuda=device.type == "cuda", interpreter=INTERPRET,
            compute_capability=(compute_capability if compute_capability is not None
                                else _compute_capability(device)),
            dkdv_requested=current_launch("bwd").kv_kernel, triton_version=_triton_version(),
        )
        if getattr(config, "apply_rope_fusion", False):
            kernels = replace(kernels, te_rope=True)
        sparse_loss = getattr(config, "msa_indexer_loss_type",
                              DEFAULT_INDEXER_LOSS_TYPE) == "sparse"
        byproducts = sparse_loss and topology.score_type == "max" and caps.block_mass
        reason = caps.why_not_fused_dense_loss(
            dtype=dtype, head_dim=topology.head_dim, index_head_dim=topology.index_head_dim,
            block_size=topology.block_size, group=topology.num_heads // topology.num_kv_heads,
            score_type=topology.score_type, cp_size=cp_size,
        )
        dense_route = "fused_dense" if reason is None else "reference_dense"
        if sparse_loss:
            route = "byproducts" if byproducts else "reference_sparse"
        else:
            route = dense_route
        # A training step asks for the block mass where the sparse loss trains (coefficient > 0).
        asks_mass = byproducts and getattr(config, "msa_indexer_loss_coeff",
                                           DEFAULT_INDEXER_LOSS_COEFF) > 0
        return cls(
            topology=topology, backend=chosen, device=device, dtype=dtype, kernels=kernels,
            cp_size=cp_size, sparse_loss=sparse_loss, loss_route=route,
            warmup_loss_route=dense_route,
            training_forward=kernels.mass_forward if asks_mass else kernels.forward,
            dense_loss_reason=reason,
        )
