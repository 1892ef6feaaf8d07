"""Backend registry: which implementation of selection and sparse attention runs where.

A backend is three functions with the signatures of ADR 0001 plus an availability check.
``resolve_backend`` picks one for a device:

1. the environment variable ``NEMO_MSA_BACKEND``, when set, wins (an operator's override that
   needs no recipe edit);
2. otherwise the requested name (the ``msa_backend`` config field), unless it is ``"auto"``;
3. ``"auto"`` takes the first available backend in preference order (flashinfer on SM100/SM103
   where it imports, triton on SM90+, then the reference, which runs anywhere).

A named backend that cannot run on the device is an error, never a silent fallback.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV_VAR = "NEMO_MSA_BACKEND"
AUTO = "auto"


@dataclass(frozen=True)
class MSABackend:
    """One implementation of the MSA ops.

    Attributes:
        name: registry key.
        select_blocks: ``(index_q [T,H,d], index_k [T,d], msa, *, top_k, init_blocks,
            local_blocks, score, return_scores=False) -> int32 [H,T,top_k]``; with
            ``return_scores`` also the per-slot block scores fp32 and keys int32 [H,T,top_k].
        attention_forward: ``(q [T,Hq,d], k [T,Hkv,d], v, q2k int32 [Hkv,T,top_k], msa,
            softmax_scale, return_block_mass=False) -> (out [T,Hq,d], lse fp32 [Hq,T])``; with
            ``return_block_mass`` the per-slot attention mass fp32 [Hkv,T,top_k] is appended
            (after the residuals, if any).
        attention_backward: ``(dout, q, k, v, out, lse, q2k, msa, softmax_scale) ->
            (dq, dk, dv)``.
        unavailable_reason: ``(device) -> str | None``; None when it runs on the device.
        description: one line for the README table and error messages.
        forward_residuals: when True, ``attention_forward`` returns ``(out, lse, residuals)``
            and ``attention_backward`` takes them as the keyword ``residuals``: state of the
            forward the backward reuses (the Triton backend's union lists).
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
    unsupported_reason: Callable[..., str | None] = lambda **shape: None


_REGISTRY: dict[str, MSABackend] = {}
# Backends that register themselves on import; imported lazily so that importing nemo_msa does
# not pull in Triton or flashinfer.
_LAZY_MODULES: dict[str, str] = {
    "flashinfer": "nemo_msa.backends_flashinfer",
    "triton": "nemo_msa.backends_triton",
}
_PREFERENCE = ("flashinfer", "triton", "reference")


def register_backend(backend: MSABackend) -> None:
    """Adds (or replaces) a backend in the registry."""
    _REGISTRY[backend.name] = backend


def _load(name: str) -> MSABackend | None:
    if name not in _REGISTRY and name in _LAZY_MODULES:
        try:
            importlib.import_module(_LAZY_MODULES[name])
        except ImportError:
            return None
    return _REGISTRY.get(name)


def known_backends() -> list[str]:
    """Names of every backend that can be requested."""
    return sorted(set(_REGISTRY) | set(_LAZY_MODULES))


def get_backend(name: str) -> MSABackend:
    """Returns a registered backend by name.

    Raises:
        ValueError: unknown name, or its module failed to import.
    """
    backend = _load(name)
    if backend is None:
        raise ValueError(
            f"MSA backend {name!r} is not available; known backends: {known_backends()} "
            f"(or {AUTO!r})"
        )
    return backend


def resolve_backend(
    requested: str | None, device: torch.device | str, **shape
) -> MSABackend:
    """Chooses the backend for a device (and, when given, a shape).

    Args:
        requested: a backend name, ``"auto"`` or None (same as auto).
        device: where the tensors live.
        **shape: what the call runs (see :attr:`MSABackend.unsupported_reason`); ``auto``
            skips backends that cannot run it, a named backend that cannot is an error.

    Returns:
        The backend to run.

    Raises:
        ValueError: an unknown name, or a named backend that cannot run on ``device`` or the
            shape (the message names the config field and its value).
    """
    device = torch.device(device)
    override = os.environ.get(ENV_VAR)
    name = override or requested or AUTO
    origin = f"{ENV_VAR}={override}" if override else f"backend={name!r}"
    if name == AUTO:
        for candidate in _PREFERENCE:
            backend = _load(candidate)
            if (backend is not None and backend.unavailable_reason(device) is None
                    and backend.unsupported_reason(**shape) is None):
                return backend
        raise ValueError(f"no MSA backend runs on device {device}")  # reference always runs
    backend = get_backend(name)
    reason = backend.unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"{origin}: the {name} backend cannot run on {device}: {reason}")
    reason = backend.unsupported_reason(**shape)
    if reason is not None:
        raise ValueError(f"{origin}: the {name} backend cannot run {reason}")
    return backend


def _reference_backend() -> MSABackend:
    from nemo_msa.attention.naive import (
        sparse_attention_backward_reference,
        sparse_attention_forward_reference,
    )
    from nemo_msa.selection.naive import select_blocks_reference

    return MSABackend(
        name="reference",
        select_blocks=select_blocks_reference,
        attention_forward=sparse_attention_forward_reference,
        attention_backward=sparse_attention_backward_reference,
        unavailable_reason=lambda device: None,
        description="pure PyTorch, chunked over queries; any device; the oracle",
    )


register_backend(_reference_backend())
