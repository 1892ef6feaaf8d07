"""The flashinfer (SM100/SM103) MSA backend; nemo_msa.backends.registry registers it when first
asked for (this module does not import the registry).

- forward: flashinfer's MSA prefill kernel (``flashinfer.msa_ops.msa_sparse_attention``, one
  sequence per document, causal), through :mod:`nemo_msa.attention.flashinfer_adapter`, which
  converts the layout, the q2k and the LSE; or the Triton forward;
- selection: the Triton backend's (``triton_select_blocks``);
- backward: the Triton backend's (``triton_attention_backward``) from the forward's
  LSE; after the prefill kernel it builds its own union lists.

Available where the device has compute capability 10.0 or 10.3 and flashinfer imports; ``auto``
prefers it there. Which forward runs is the layer's plan's (``MSAKernels.forward`` and
``mass_forward``, ADR 0048): the prefill kernel where it takes the layer's shape (block size and
head dim 128, top_k <= 16, at most 16 query heads per KV head; ADR 0014) and the call (no block
mass, no query subset), the Triton forward otherwise. Importing this module imports Triton but
never flashinfer.
"""

from __future__ import annotations

import torch

from nemo_msa import unplanned
from nemo_msa.attention import flashinfer_adapter
from nemo_msa.backends import triton as triton_backend
from nemo_msa.backends.capabilities import FLASHINFER_PREFILL
from nemo_msa.backends.spec import MSABackend, require_kernel

#: Compute capabilities of flashinfer's SM100/SM103 MSA prefill (B200/GB200, B300/GB300).
SUPPORTED_CAPABILITIES = ((10, 0), (10, 3))


def _unavailable_reason(device: torch.device) -> str | None:
    device = torch.device(device)
    wanted = "compute capability 10.0 or 10.3 (SM100/SM103: B200, GB200, B300, GB300)"
    if device.type != "cuda":
        return f"flashinfer's MSA prefill kernel needs a CUDA GPU of {wanted}; got {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) not in SUPPORTED_CAPABILITIES:
        return (f"flashinfer's MSA prefill kernel (as this backend uses it) needs {wanted}; "
                f"{device} has {major}.{minor}")
    try:
        flashinfer_adapter.load_msa_sparse_attention()
    except Exception as error:  # ImportError, or flashinfer's own failure to initialise
        return (f"flashinfer.msa_ops does not import ({type(error).__name__}: {error}); "
                f'install it with pip install -e ".[flashinfer]"')
    return None


def _forward(q, k, v, selection, view, softmax_scale, *, return_block_mass=False, kernel=None):
    """``(out, lse[, block mass])`` from the forward ``kernel`` names: ``"flashinfer"`` (the
    prefill kernel) or ``"triton"`` (the Triton forward; its union lists stay with the
    selection for the backward). The per-slot block mass of the sparse indexer loss and the
    query subset of context parallelism are the Triton forward's only; a layer's plan names
    the Triton forward for them (:func:`nemo_msa.plan.choose_kernels`). None (a direct user,
    no plan): the prefill kernel where the call takes it, else the Triton forward.

    Raises:
        ValueError: ``kernel="flashinfer"`` on a call the prefill kernel does not take (naming
            ``MSAKernels.forward``).
    """
    reason = _prefill_refusal(q, k, selection.q2k, view, return_block_mass)
    if kernel is None:
        unplanned.record("forward")
        kernel = "flashinfer" if reason is None else "triton"
    require_kernel("forward", kernel, ("flashinfer", "triton"))
    if kernel == "triton":
        return triton_backend.BACKEND.attention_forward(
            q, k, v, selection, view, softmax_scale, return_block_mass=return_block_mass,
            kernel="triton")
    if reason is not None:
        raise ValueError(f"MSAKernels.forward='flashinfer' but this call has {reason}; the "
                         "layer's plan did not foresee it")
    return flashinfer_adapter.flashinfer_attention_forward(
        q, k, v, selection.q2k, view.msa, softmax_scale, canonical=selection.canonical)


def _prefill_refusal(q, k, q2k, view, return_block_mass: bool) -> str | None:
    """Why flashinfer's prefill kernel does not take this call (None when it does)."""
    if return_block_mass:
        return "return_block_mass=True (flashinfer's kernel gives no per-slot block mass)"
    if view.queries is not None:
        return "a query subset (flashinfer's kernel takes every token as a query)"
    return flashinfer_adapter.unsupported_shape_reason(q, k, q2k, view.msa)


BACKEND = MSABackend(
    name="flashinfer",
    select_blocks=triton_backend.BACKEND.select_blocks,
    attention_forward=_forward,
    attention_backward=triton_backend.BACKEND.attention_backward,
    unavailable_reason=_unavailable_reason,
    # Selection and backward (and the forward's fallback) are the Triton kernels.
    capabilities=triton_backend.BACKEND.capabilities,
    preferred_forward=FLASHINFER_PREFILL,
    description="SM100/SM103: flashinfer's MSA prefill forward (the Triton forward where the "
    "sparse indexer loss's block mass or a CP query subset is asked for), Triton selection and "
    "deterministic Triton backward",
)
