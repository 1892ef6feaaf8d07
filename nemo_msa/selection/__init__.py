"""Block-selection kernels and references (the layer below the ops, ADR 0017).

- :mod:`nemo_msa.selection.naive`: the plain-PyTorch selection, the oracle of every kernel;
- :mod:`nemo_msa.selection.triton_select`: the Triton kernel (imported by the Triton backend
  module only: it needs Triton).

The public op :func:`nemo_msa.select_blocks` (validation, backend dispatch, the canonical mark)
lives in :mod:`nemo_msa.ops`; this package only re-exports the reference.
"""

from nemo_msa.selection.naive import select_blocks_reference

__all__ = ["select_blocks_reference"]
