"""The Triton (SM90) MSA backend; nemo_msa.backends.registry registers it when first asked for
(this module does not import the registry).

The kernels live in nemo_msa/selection/triton_select.py, nemo_msa/attention/triton_fwd.py and
nemo_msa/attention/triton_bwd.py (design and measurements: docs/adr/0003-*). The backward uses
no atomics and is bitwise repeatable; its dk/dv kernel (Triton, or Gluon on SM90) is the
plan's ``MSAKernels.dkdv``. The helpers a layer on it runs are ``TRITON``'s record's.
"""

from __future__ import annotations

import torch

from nemo_msa.attention.triton_bwd import triton_attention_backward
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.backends.capabilities import TRITON
from nemo_msa.backends.spec import MSABackend, require_kernel
from nemo_msa.selection.triton_select import triton_select_blocks


def _unavailable_reason(device: torch.device) -> str | None:
    device = torch.device(device)
    if device.type != "cuda":
        return (f"needs a CUDA GPU, got device {device} (the Triton interpreter runs the "
                f"kernels on the CPU in their own tests only)")
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"needs compute capability >= 8.0 (tuned for 9.0), got {major}.{minor}"
    return None


# A view's ``queries`` (int64 [Tq] global compact rows, or None for every token): the query
# subset of context parallelism (ADR 0021); query-side tensors then have Tq rows, key-side ones
# T.


def _select(index_q, index_k, view, *, top_k, init_blocks, local_blocks, score="max"):
    return triton_select_blocks(index_q, index_k, view.msa, top_k=top_k,
                                init_blocks=init_blocks, local_blocks=local_blocks, score=score,
                                queries=view.queries)


def _forward(q, k, v, selection, view, softmax_scale, *, return_block_mass=False, kernel=None):
    require_kernel("forward", kernel, ("triton",))
    # The union lists stay with the selection: dq reuses them instead of building its own.
    out, lse, selection.unions, *mass = triton_attention_forward(
        q, k, v, selection.q2k, view.msa, softmax_scale, return_unions=True,
        return_block_mass=return_block_mass, queries=view.queries)
    return (out, lse, *mass)


def _backward(dout, q, k, v, out, lse, selection, view, softmax_scale, *, dkdv=None):
    return triton_attention_backward(dout, q, k, v, out, lse, selection.q2k, view.msa,
                                     softmax_scale, unions=selection.unions,
                                     queries=view.queries, dkdv=dkdv)


BACKEND = MSABackend(
    name="triton",
    select_blocks=_select,
    attention_forward=_forward,
    attention_backward=_backward,
    unavailable_reason=_unavailable_reason,
    capabilities=TRITON,
    description="Triton kernels for SM90: fused select+top-k, hybrid union/per-token "
    "forward, deterministic backward (union/per-token dq, KV-outer dk/dv)",
)
