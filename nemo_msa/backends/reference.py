"""The reference MSA backend: the plain-PyTorch selection and attention, any device, the oracle.

It has the query-subset mode (a view with ``queries``, context parallelism) in all three
functions, and runs its helpers on their torch references (``REFERENCE``'s record).

Registered by nemo_msa.backends.registry when it loads (this module does not import the
registry).
"""

from __future__ import annotations

from nemo_msa.attention.naive import (
    sparse_attention_backward_reference,
    sparse_attention_forward_reference,
)
from nemo_msa.backends.capabilities import REFERENCE
from nemo_msa.backends.spec import MSABackend, require_kernel
from nemo_msa.selection.naive import select_blocks_reference

__all__ = ["BACKEND"]


def _select(index_q, index_k, view, *, top_k, init_blocks, local_blocks, score="max"):
    return select_blocks_reference(index_q, index_k, view.msa, top_k=top_k,
                                   init_blocks=init_blocks, local_blocks=local_blocks,
                                   score=score, queries=view.queries)


def _forward(q, k, v, selection, view, softmax_scale, *, return_block_mass=False, kernel=None):
    require_kernel("forward", kernel, ("reference",))
    return sparse_attention_forward_reference(q, k, v, selection.q2k, view.msa, softmax_scale,
                                              return_block_mass=return_block_mass,
                                              queries=view.queries)


def _backward(dout, q, k, v, out, lse, selection, view, softmax_scale, *, dkdv=None):
    require_kernel("dkdv", dkdv, ("reference",))
    return sparse_attention_backward_reference(dout, q, k, v, out, lse, selection.q2k,
                                               view.msa, softmax_scale, queries=view.queries)


BACKEND = MSABackend(
    name="reference",
    select_blocks=_select,
    attention_forward=_forward,
    attention_backward=_backward,
    capabilities=REFERENCE,
    unavailable_reason=lambda device: None,
    description="pure PyTorch, chunked over queries; any device and floating dtype; the oracle",
)
