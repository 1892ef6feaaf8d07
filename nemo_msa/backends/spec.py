"""What an MSA backend is: :class:`MSABackend`, the record the registry holds.

Its own module, below the registry (nemo_msa.backends) and the backend modules
(nemo_msa.backends.reference, backends_triton, backends_flashinfer), so that a backend module
describes itself without importing the registry that loads it (ADR 0017).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nemo_msa.backends.capabilities import MSACapabilities

__all__ = ["MSABackend"]


@dataclass(frozen=True)
class MSABackend:
    """One implementation of the MSA ops.

    Attributes:
        name: registry key.
        select_blocks: ``(index_q [T,H,d], index_k [T,d], msa, *, top_k, init_blocks,
            local_blocks, score[, queries]) -> int32 [H,T,top_k]``.
            With ``queries`` (int64 [Tq] global compact rows of a query subset, only passed to
            a backend whose capabilities declare ``query_subset``) index_q and the outputs have
            Tq token rows.
        attention_forward: ``(q [T,Hq,d], k [T,Hkv,d], v, q2k int32 [Hkv,T,top_k], msa,
            softmax_scale, return_block_mass=False[, queries]) -> (out [T,Hq,d], lse fp32
            [Hq,T])``; with ``return_block_mass`` the per-slot attention mass fp32
            [Hkv,T,top_k] is appended (after the residuals, if any). With ``queries`` q, q2k,
            out, lse and mass have Tq token rows, k and v every token's.
        attention_backward: ``(dout, q, k, v, out, lse, q2k, msa, softmax_scale[, queries])
            -> (dq, dk, dv)``; with ``queries`` dq has Tq rows, dk/dv every token's (the local
            queries' share).
        capabilities: what it runs
            (:class:`~nemo_msa.backends.capabilities.MSACapabilities`): the plan
            (nemo_msa.plan) and ``auto`` ask its ``why_not`` before anything runs; its
            ``query_subset`` says whether the three functions take ``queries``.
        unavailable_reason: ``(device) -> str | None``; None when it runs on the device.
        description: one line for the README table and error messages.
        forward_residuals: when True, ``attention_forward`` returns ``(out, lse, residuals)``
            and ``attention_backward`` takes them as the keyword ``residuals``: state of the
            forward the backward reuses (the Triton backend's union lists).
        preferred_forward: the record of a forward kernel ``attention_forward`` prefers where
            it differs from ``capabilities`` (flashinfer's prefill); a call it cannot take (a
            shape outside it, the block mass, a query subset) runs the forward that
            ``capabilities`` describes. None: ``capabilities`` describes the forward.
    """

    name: str
    select_blocks: Callable
    attention_forward: Callable
    attention_backward: Callable
    capabilities: MSACapabilities
    unavailable_reason: Callable[[torch.device], str | None]
    description: str
    forward_residuals: bool = False
    preferred_forward: MSACapabilities | None = None

    def why_not(self, **shape) -> str | None:
        """:meth:`MSACapabilities.why_not` of this backend (None when it runs ``shape``)."""
        return self.capabilities.why_not(**shape)
