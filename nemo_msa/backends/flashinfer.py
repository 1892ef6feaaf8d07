"""The flashinfer (SM100/SM103) MSA backend; nemo_msa.backends registers it when first asked
for (this module does not import the registry).

- forward: flashinfer's MSA prefill kernel (``flashinfer.msa_ops.msa_sparse_attention``, one
  sequence per document, causal), through :mod:`nemo_msa.attention.flashinfer_adapter`, which
  converts the layout, the q2k and the LSE;
- selection: the Triton backend's (``triton_select_blocks``);
- backward: the Triton backend's (``triton_attention_backward``) from the forward's
  LSE; it builds its own union lists.

Available where the device has compute capability 10.0 or 10.3 and flashinfer imports; ``auto``
prefers it there. Shapes the kernel does not take (block size or head dim other than 128,
top_k > 16, more than 16 query heads per KV head) run the Triton forward instead, with one
warning per reason (ADR 0014). Importing this module imports Triton but never flashinfer.
"""

from __future__ import annotations

import logging

import torch

from nemo_msa.attention import flashinfer_adapter
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.backends import triton as triton_backend
from nemo_msa.backends.capabilities import FLASHINFER_PREFILL
from nemo_msa.backends.spec import MSABackend

logger = logging.getLogger(__name__)

#: Compute capabilities of flashinfer's SM100/SM103 MSA prefill (B200/GB200, B300/GB300).
SUPPORTED_CAPABILITIES = ((10, 0), (10, 3))
_WARNED: set[str] = set()


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


def _forward(q, k, v, q2k, msa, softmax_scale, return_block_mass=False, queries=None):
    """``(out, lse, residuals)``: flashinfer's forward (residuals None), or for shapes it does
    not take the Triton forward (residuals: its union lists). The per-slot block mass of the
    sparse indexer loss (``return_block_mass``) and the query subset of context parallelism
    (``queries``) are the Triton forward's only, so those steps run the Triton forward (the same
    function)."""
    if return_block_mass or queries is not None:
        return triton_attention_forward(q, k, v, q2k, msa, softmax_scale, return_unions=True,
                                        return_block_mass=return_block_mass, queries=queries)
    reason = flashinfer_adapter.unsupported_shape_reason(q, k, q2k, msa)
    if reason is None:
        out, lse = flashinfer_adapter.flashinfer_attention_forward(q, k, v, q2k, msa,
                                                                   softmax_scale)
        return out, lse, None
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning("MSA backend flashinfer: %s; this layer's forward runs the Triton "
                       "kernel instead", reason)
    return triton_attention_forward(q, k, v, q2k, msa, softmax_scale, return_unions=True)


BACKEND = MSABackend(
    name="flashinfer",
    select_blocks=triton_backend.BACKEND.select_blocks,
    attention_forward=_forward,
    attention_backward=triton_backend.BACKEND.attention_backward,
    unavailable_reason=_unavailable_reason,
    # Selection and backward (and the forward's fallback) are the Triton kernels.
    capabilities=triton_backend.BACKEND.capabilities,
    forward_residuals=True,
    preferred_forward=FLASHINFER_PREFILL,
    description="SM100/SM103: flashinfer's MSA prefill forward (the Triton forward where the "
    "sparse indexer loss's block mass or a CP query subset is asked for), Triton selection and "
    "deterministic Triton backward",
)
