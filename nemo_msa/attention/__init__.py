"""Attention kernels and references on compact tokens (the layer below the ops, ADR 0017).

- :mod:`nemo_msa.attention.dense`: dense causal attention within documents (dense layers, the
  dense warm-up; cuDNN SDPA per run of equal-length documents on the GPU, ADR 0012);
- :mod:`nemo_msa.attention.naive`: the plain-PyTorch sparse-attention reference and dense oracles;
- ``triton_*`` and ``flashinfer_adapter``: the kernels of the Triton and flashinfer backends
  (imported by their backend modules only: they need Triton).

The public op :func:`nemo_msa.sparse_attention` (validation, autograd, backend dispatch) lives in
:mod:`nemo_msa.ops`; this package only re-exports the dense attention.
"""

from nemo_msa.attention.dense import (
    dense_document_attention,
    dense_document_attention_per_document,
    dense_document_attention_rows,
)

__all__ = [
    "dense_document_attention",
    "dense_document_attention_per_document",
    "dense_document_attention_rows",
]
