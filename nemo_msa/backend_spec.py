"""What an MSA backend is: :class:`MSABackend`, the record the registry holds.

Its own module, below the registry (nemo_msa.backends) and the backend modules
(nemo_msa.backends_reference, backends_triton, backends_flashinfer), so that a backend module
describes itself without importing the registry that loads it (ADR 0017).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["MSABackend"]


@dataclass(frozen=True)
class MSABackend:
    """One implementation of the MSA ops.

    Attributes:
        name: registry key.
        select_blocks: ``(index_q [T,H,d], index_k [T,d], msa, *, top_k, init_blocks,
            local_blocks, score, return_scores=False[, queries]) -> int32 [H,T,top_k]``; with
            ``return_scores`` also the per-slot block scores fp32 and keys int32 [H,T,top_k].
            With ``queries`` (int64 [Tq] global compact rows of a query subset, only passed to
            a backend with ``supports_queries``) index_q and the outputs have Tq token rows.
        attention_forward: ``(q [T,Hq,d], k [T,Hkv,d], v, q2k int32 [Hkv,T,top_k], msa,
            softmax_scale, return_block_mass=False[, queries]) -> (out [T,Hq,d], lse fp32
            [Hq,T])``; with ``return_block_mass`` the per-slot attention mass fp32
            [Hkv,T,top_k] is appended (after the residuals, if any). With ``queries`` q, q2k,
            out, lse and mass have Tq token rows, k and v every token's.
        attention_backward: ``(dout, q, k, v, out, lse, q2k, msa, softmax_scale[, queries])
            -> (dq, dk, dv)``; with ``queries`` dq has Tq rows, dk/dv every token's (the local
            queries' share).
        unavailable_reason: ``(device) -> str | None``; None when it runs on the device.
        description: one line for the README table and error messages.
        forward_residuals: when True, ``attention_forward`` returns ``(out, lse, residuals)``
            and ``attention_backward`` takes them as the keyword ``residuals``: state of the
            forward the backward reuses (the Triton backend's union lists).
        supports_queries: whether the three functions take the keyword ``queries`` (the
            query subset of context parallelism); the ops refuse ``queries`` otherwise.
        unsupported_reason: ``(**shape) -> str | None``: why the backend cannot run a shape,
            from the keywords it is given (``score_type``, ``head_dim``, ``index_head_dim``,
            ``block_size``, ``top_k``, ``dtype``; absent ones are not checked), naming the
            config field (``msa_score_type=...``); None when it can. The construction gate and
            ``auto`` ask it before anything runs.
    """

    name: str
    select_blocks: Callable
    attention_forward: Callable
    attention_backward: Callable
    unavailable_reason: Callable[[torch.device], str | None]
    description: str
    forward_residuals: bool = False
    supports_queries: bool = False
    unsupported_reason: Callable[..., str | None] = lambda **shape: None
