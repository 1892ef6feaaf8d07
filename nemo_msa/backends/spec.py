"""What an MSA backend is: :class:`MSABackend`, the record the registry holds.

Its own module, below the registry (nemo_msa.backends.registry) and the backend modules
(nemo_msa.backends.reference, .triton, .flashinfer), so that a backend module describes itself
without importing the registry that loads it (ADR 0017).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nemo_msa.backends.capabilities import MSACapabilities

__all__ = ["MSABackend", "require_kernel"]


@dataclass(frozen=True)
class MSABackend:
    """One implementation of the MSA ops.

    The ops hand a backend a :class:`~nemo_msa.query_view.QueryView` (the layout and, under
    context parallelism, the query subset) and a :class:`~nemo_msa.q2k.Selection` (a canonical
    q2k); the backend unpacks them into its kernels' arguments.

    Attributes:
        name: registry key.
        select_blocks: ``(index_q [Tq,H,d], index_k [T,d], view, *, top_k, init_blocks,
            local_blocks, score) -> int32 [H,Tq,top_k]`` (canonical). A view with a query
            subset (int64 [Tq] global compact rows) reaches only a backend whose capabilities
            declare ``query_subset``.
        attention_forward: ``(q [Tq,Hq,d], k [T,Hkv,d], v, selection, view, softmax_scale, *,
            return_block_mass=False, kernel=None) -> (out [Tq,Hq,d], lse fp32 [Hq,Tq])``; with
            ``return_block_mass`` the per-slot attention mass fp32 [Hkv,Tq,top_k] is appended.
            ``kernel``: the forward kernel a plan named (:attr:`MSAKernels.forward` or
            ``mass_forward``); a call it does not take raises ValueError naming the field.
            None: the backend chooses per call (a direct user). It may keep state of the
            selection for its backward on the selection (the Triton union lists,
            ``selection.unions``).
        attention_backward: ``(dout, q, k, v, out, lse, selection, view, softmax_scale, *,
            dkdv=None) -> (dq, dk, dv)``; dq has Tq rows, dk/dv every token's (the local
            queries' share). ``dkdv``: the dk/dv kernel a plan named (:attr:`MSAKernels.dkdv`),
            None: chosen per call.
        capabilities: what it runs
            (:class:`~nemo_msa.backends.capabilities.MSACapabilities`, with the helper kernels
            a layer on it runs): the plan (nemo_msa.plan) and ``auto`` ask its ``why_not``
            before anything runs; its ``query_subset`` says whether the functions take a view
            with a query subset.
        unavailable_reason: ``(device) -> str | None``; None when it runs on the device.
        description: one line for the README table and error messages.
        preferred_forward: the record of a forward kernel ``attention_forward`` prefers where
            it differs from ``capabilities`` (flashinfer's prefill); the plan names it where it
            takes the layer, the forward that ``capabilities`` describes otherwise (a shape
            outside it, the block mass, a query subset). None: ``capabilities`` describes the
            forward.

    (:class:`MSAKernels` is :class:`nemo_msa.plan.MSAKernels`.)
    """

    name: str
    select_blocks: Callable
    attention_forward: Callable
    attention_backward: Callable
    capabilities: MSACapabilities
    unavailable_reason: Callable[[torch.device], str | None]
    description: str
    preferred_forward: MSACapabilities | None = None

    def why_not(self, **shape) -> str | None:
        """:meth:`MSACapabilities.why_not` of this backend (None when it runs ``shape``)."""
        return self.capabilities.why_not(**shape)


def require_kernel(field: str, named: str | None, runs: tuple[str, ...]) -> None:
    """Refuses a kernel a plan named that this backend does not run.

    Args:
        field: the plan's field (``"forward"``, ``"dkdv"``).
        named: the kernel the plan named, or None (a direct call: no plan).
        runs: the kernels the backend runs for that field.

    Raises:
        ValueError: naming ``MSAKernels.<field>``.
    """
    if named is not None and named not in runs:
        raise ValueError(f"MSAKernels.{field}={named!r}: this backend runs {runs}; the plan "
                         "was built for another backend")
