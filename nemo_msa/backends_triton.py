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
from nemo_msa.backend_spec import MSABackend
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


#: What the kernels take (nemo_msa/selection/triton_select.py, nemo_msa/attention/triton_*.py).
KERNEL_DIMS = (16, 32, 64, 128)


def unsupported_reason(*, score_type=None, head_dim=None, index_head_dim=None, block_size=None,
                       top_k=None, dtype=None) -> str | None:
    """Why the Triton kernels cannot run a shape (naming the config field), or None."""
    if score_type is not None and score_type != "max":
        return (f"msa_score_type={score_type!r}: the Triton selection implements 'max' only "
                f"(use the reference backend for 'lse')")
    for field, value in (("kv_channels", head_dim), ("msa_index_head_dim", index_head_dim),
                         ("msa_block_size", block_size)):
        if value is not None and value not in KERNEL_DIMS:
            return f"{field}={value}: the Triton kernels take one of {KERNEL_DIMS}"
    if top_k is not None and not 1 <= top_k <= 32:
        return f"msa_topk={top_k}: the Triton kernels take 1..32"
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return (f"params dtype {dtype}: the Triton kernels read bf16/fp16 (set model.bf16=true "
                f"or use the reference backend)")
    return None


# ``queries`` (int64 [Tq] global compact rows, or None for every token): the query subset of
# context parallelism (ADR 0021); query-side tensors then have Tq rows, key-side ones T.


def _select(index_q, index_k, msa, *, top_k, init_blocks, local_blocks, score="max",
            return_scores=False, queries=None):
    return triton_select_blocks(index_q, index_k, msa, top_k=top_k, init_blocks=init_blocks,
                                local_blocks=local_blocks, score=score,
                                return_scores=return_scores, queries=queries)


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
    unsupported_reason=unsupported_reason,
    forward_residuals=True,
    description="Triton kernels for SM90: fused select+top-k, hybrid union/per-token "
    "forward, deterministic backward (union/per-token dq, KV-outer dk/dv)",
)
