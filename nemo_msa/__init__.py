"""nemo-msa: MSA block-sparse attention (MiniMax-M3 style) for Megatron-Core.

Public API (CPU reference everywhere, kernels where the device has them):

- :class:`MSAMicrobatch`: the per-microbatch layout (document map, pack/unpack, workspace),
  memoized per batch tensor.
- :func:`select_blocks`: index scorer + top-k block selection (:func:`select`: the same as a
  :class:`Selection`, which :func:`sparse_attention` takes without a canonical pass).
- :func:`sparse_attention`: differentiable block-sparse attention.
- :func:`dense_document_attention`: dense causal attention within documents (dense layers, the
  dense warm-up; cuDNN per document on the GPU).
- :func:`require_msa_support`, :func:`check_runtime_arguments`: the support gate.
- :func:`resolve_backend`, :func:`register_backend`: the backend registry
  (:mod:`nemo_msa.backends`).
- :class:`QueryView`: a layout with a query subset (context parallelism's local queries).

This file only re-exports; the modules and their one-way layers are in docs/adr/0017.
"""

from nemo_msa.attention.dense import dense_document_attention
from nemo_msa.backends.registry import MSABackend, register_backend, resolve_backend
from nemo_msa.layout import MSAMicrobatch
from nemo_msa.ops import select, select_blocks, sparse_attention
from nemo_msa.q2k import Selection
from nemo_msa.query_view import QueryView
from nemo_msa.support import MSATopology, check_runtime_arguments, require_msa_support

__all__ = [
    "MSABackend",
    "MSAMicrobatch",
    "MSATopology",
    "QueryView",
    "Selection",
    "check_runtime_arguments",
    "dense_document_attention",
    "register_backend",
    "require_msa_support",
    "resolve_backend",
    "select",
    "select_blocks",
    "sparse_attention",
]

__version__ = "0.1.0"
