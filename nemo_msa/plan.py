"""One resolved plan per MSA layer: what runs, decided once when the layer is built (ADR 0019).

:meth:`MSAPlan.build` is the construction gate: the config's refusals and topology
(:func:`nemo_msa.support.require_msa_support`), the backend for the device (the registry, with
``NEMO_MSA_BACKEND`` read here and nowhere later), the backend's capability record asked for the
layer's shape and dtype, whether the helpers around the ops run fused, and the indexer loss's
path. The layer keeps the plan and passes ``plan.backend`` (an
:class:`~nemo_msa.backend_spec.MSABackend`, not a name) to the ops and ``plan.fused_helpers`` to
the helpers, so a training step makes no registry lookup and repeats no range check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_msa.backend_spec import MSABackend
from nemo_msa.backends import resolve_backend
from nemo_msa.support import (
    DEFAULT_INDEXER_LOSS_COEFF,
    DEFAULT_INDEXER_LOSS_TYPE,
    MSATopology,
    require_msa_support,
)

__all__ = ["MSAPlan", "params_dtype"]


def params_dtype(config: Any) -> torch.dtype:
    """The dtype a Megatron config trains its parameters in (bf16, fp16, else fp32)."""
    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    return torch.float32


@dataclass(frozen=True)
class MSAPlan:
    """What one MSA layer runs, resolved at construction.

    Attributes:
        topology: the validated topology (heads, dims, block size, top_k, forced blocks, score).
        backend: the resolved backend; the ops take it as it is.
        device: where the layer runs.
        dtype: the layer's parameter dtype (q/k/v and the indexer's).
        cp_size: the context-parallel group size the layer was built in.
        fused_helpers: the layer's helpers around the ops run fused where their inputs allow
            (:attr:`~nemo_msa.capabilities.MSACapabilities.fused_helpers` of the backend: its
            q/k and index norms, RoPE, the by-product loss's passes, the recall, the dense
            path's per-document SDPA); False (the reference backend): their torch references.
            The layer passes it down; the helpers decide per call from the device only where
            no plan exists (a direct caller).
        sparse_loss: ``msa_indexer_loss_type="sparse"``: past the dense warm-up the indexer
            loss is the KL over the selected blocks (else over every candidate block).
        loss_from_byproducts: the sparse indexer loss takes its target from the sparse
            forward's block mass (``msa_indexer_loss_type="sparse"``, score ``"max"``; ADR 0016,
            0033); otherwise :func:`nemo_msa.indexer_loss.compute_indexer_loss` recomputes its
            target.
        training_forward: the record name of the forward kernel a training step past the dense
            warm-up runs: the backend's preferred forward (flashinfer's prefill) where it takes
            the layer's shape, context parallelism and the loss's needs, else the forward of
            the backend's ``capabilities`` (the Triton forward under the sparse indexer loss,
            which asks for the block mass every step). Evaluation without the loss may run the
            preferred one.
        fused_dense_loss: the dense indexer loss (dense warm-up, or
            ``msa_indexer_loss_type="dense"``) runs fused in Triton
            (:func:`nemo_msa.indexer_loss.dense_indexer_loss_triton`) rather than on the
            chunked reference (the same function; ADR 0018).
        dense_loss_reason: why the dense loss takes the reference (None when fused).
    """

    topology: MSATopology
    backend: MSABackend
    device: torch.device
    dtype: torch.dtype
    cp_size: int = 1
    fused_helpers: bool = False
    sparse_loss: bool = False
    loss_from_byproducts: bool = False
    training_forward: str = ""
    fused_dense_loss: bool = False
    dense_loss_reason: str | None = None

    @classmethod
    def build(
        cls,
        config: Any,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        cp_size: int = 1,
        backend: str | None = None,
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
        sparse_loss = getattr(config, "msa_indexer_loss_type",
                              DEFAULT_INDEXER_LOSS_TYPE) == "sparse"
        byproducts = sparse_loss and topology.score_type == "max" and caps.block_mass
        reason = caps.why_not_fused_dense_loss(
            dtype=dtype, head_dim=topology.head_dim, index_head_dim=topology.index_head_dim,
            block_size=topology.block_size, group=topology.num_heads // topology.num_kv_heads,
            score_type=topology.score_type, cp_size=cp_size,
        )
        preferred = chosen.preferred_forward
        # A training step asks for the block mass where the sparse loss trains (coefficient > 0).
        asks_mass = byproducts and getattr(config, "msa_indexer_loss_coeff",
                                           DEFAULT_INDEXER_LOSS_COEFF) > 0
        takes_all = preferred is not None and (preferred.block_mass or not asks_mass) \
            and preferred.why_not(dtype=dtype, head_dim=topology.head_dim,
                                  block_size=topology.block_size, top_k=topology.top_k,
                                  group=topology.num_heads // topology.num_kv_heads,
                                  cp_size=cp_size) is None
        return cls(
            topology=topology, backend=chosen, device=device, dtype=dtype, cp_size=cp_size,
            fused_helpers=caps.fused_helpers, sparse_loss=sparse_loss,
            loss_from_byproducts=byproducts,
            training_forward=preferred.name if takes_all else caps.name,
            fused_dense_loss=reason is None, dense_loss_reason=reason,
        )
