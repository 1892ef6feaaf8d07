"""Pieces the Triton kernels of attention/, selection/ and indexer_loss/ share.

- :mod:`nemo_msa.triton.kernel_layout`: the kernels' typed view of a layout (torch only; the
  layout module builds it, so it sits in the layout layer of ADR 0017);
- :mod:`nemo_msa.triton.launch`: the launch settings (tile sizes, warps, stages) and their
  overrides;
- :mod:`nemo_msa.triton.tiles`: the ``@triton.jit`` tile helpers.

Nothing is re-exported here: importing the kernel layout view must not import Triton.
"""
