"""The Triton (SM90) MSA backend; nemo_msa.backends registers it when first asked for (this
module does not import the registry).

The kernels live in nemo_msa/selection/triton_select.py, nemo_msa/attention/triton_fwd.py and
nemo_msa/attention/triton_bwd.py (design and measurements: docs/adr/0003-*). The backward uses
no atomics and is bitwise repeatable.
"""

from __future__ import annotations

import torch

from nemo_msa.attention.triton_bwd import triton_attention_backward
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.backends.capabilities import TRITON
from nemo_msa.backends.spec import MSABackend
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


# ``queries`` (int64 [Tq] global compact rows, or None for every token): the query subset of
# context parallelism (ADR 0021); query-side tensors then have Tq rows, key-side ones T.


def _select(index_q, index_k, msa, *, top_k, init_blocks, local_blocks, score="max",
            queries=None):
    return triton_select_blocks(index_q, index_k, msa, top_k=top_k, init_blocks=init_blocks,
                                local_blocks=local_blocks, score=score, queries=queries)


def _forward(q, k, v, q2k, msa, softmax_scale, return_block_mass=False, queries=None):
    # The union lists are the residual: dq reuses them instead of building its own.
    return triton_attention_forward(q, k, v, q2k, msa, softmax_scale, return_unions=True,
                                    return_block_mass=return_block_mass, queries=queries)


def _backward(dout, q, k, v, out, lse, q2k, msa, softmax_scale, *, residuals=None,
              queries=None):
    return triton_attention_backward(dout, q, k, v, out, lse, q2k, msa, softmax_scale,
                                     unions=residuals, queries=queries)


BACKEND = MSABackend(
    name="triton",
    select_blocks=_select,
    attention_forward=_forward,
    attention_backward=_backward,
    unavailable_reason=_unavailable_reason,
    capabilities=TRITON,
    forward_residuals=True,
    description="Triton kernels for SM90: fused select+top-k, hybrid union/per-token "
    "forward, deterministic backward (union/per-token dq, KV-outer dk/dv)",
)
