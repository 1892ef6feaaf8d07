"""Backend registry: which implementation of selection and sparse attention runs where.

A backend (:class:`~nemo_msa.backends.spec.MSABackend`) is three functions (selection, forward,
backward) plus an availability check and its capability record. The reference backend
(nemo_msa.backends.reference) is registered when this module loads; the kernel backends when
first asked for. ``resolve_backend`` picks one for a device:

1. the environment variable ``NEMO_MSA_BACKEND``, when set, wins (an operator's override that
   needs no recipe edit);
2. otherwise the requested name (the ``msa_backend`` config field), unless it is ``"auto"``;
3. ``"auto"`` takes the first available backend in preference order (flashinfer on SM100/SM103
   where it imports, triton on SM90+, then the reference, which runs anywhere).

A named backend that cannot run on the device is an error, never a silent fallback. A layer
resolves its backend once, when it is built (:class:`nemo_msa.plan.MSAPlan`), and passes its
plan to the ops; the ops resolve a name per call for direct users only.
"""

from __future__ import annotations

import importlib
import os

import torch

from nemo_msa.backends import reference as backends_reference
from nemo_msa.backends.spec import MSABackend

__all__ = [
    "AUTO",
    "ENV_VAR",
    "MSABackend",
    "get_backend",
    "known_backends",
    "register_backend",
    "resolve_backend",
]

ENV_VAR = "NEMO_MSA_BACKEND"
AUTO = "auto"

_REGISTRY: dict[str, MSABackend] = {}
# The kernel backends' modules, imported by name on first request: they import Triton (and
# flashinfer's adapter), an optional heavy dependency that `import nemo_msa` must not pull in,
# and a missing one must leave the other backends usable. Importing by name is not an upward
# import: each module defines its ``BACKEND`` from nemo_msa.backends.spec and the kernels below
# it, and never imports this registry; :func:`_load` registers that ``BACKEND`` here.
_LAZY_MODULES: dict[str, str] = {
    "flashinfer": "nemo_msa.backends.flashinfer",
    "triton": "nemo_msa.backends.triton",
}
_PREFERENCE = ("flashinfer", "triton", "reference")


def register_backend(backend: MSABackend) -> None:
    """Adds (or replaces) a backend in the registry."""
    _REGISTRY[backend.name] = backend


def _load(name: str) -> MSABackend | None:
    if name not in _REGISTRY and name in _LAZY_MODULES:
        try:
            module = importlib.import_module(_LAZY_MODULES[name])
        except ImportError:
            return None
        register_backend(module.BACKEND)
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
        **shape: what the call runs (the keywords of
            :meth:`~nemo_msa.backends.capabilities.MSACapabilities.why_not`); ``auto`` skips
            backends that cannot run it, a named backend that cannot is an error.

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
        refusals = []
        for candidate in _PREFERENCE:
            backend = _load(candidate)
            if backend is None:
                continue
            reason = backend.unavailable_reason(device) or backend.why_not(**shape)
            if reason is None:
                return backend
            refusals.append(f"{candidate}: {reason}")
        raise ValueError(f"{origin}: no MSA backend runs this on {device} ("
                         + "; ".join(refusals) + ")")
    try:
        backend = get_backend(name)
    except ValueError as error:  # an unknown name: say where it came from (issue #29)
        raise ValueError(f"{origin}: {error}") from None
    reason = backend.unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"{origin}: the {name} backend cannot run on {device}: {reason}")
    reason = backend.why_not(**shape)
    if reason is not None:
        raise ValueError(f"{origin}: the {name} backend cannot run {reason}")
    return backend


register_backend(backends_reference.BACKEND)
