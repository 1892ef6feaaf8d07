"""The reference MSA backend: the plain-PyTorch selection and attention, any device, the oracle.

It has the query-subset mode (``queries=``, context parallelism) in all three functions.

Registered by nemo_msa.backends when it loads (this module does not import the registry).
"""

from __future__ import annotations

from nemo_msa.attention.naive import (
    sparse_attention_backward_reference,
    sparse_attention_forward_reference,
)
from nemo_msa.backends.capabilities import REFERENCE
from nemo_msa.backends.spec import MSABackend
from nemo_msa.selection.naive import select_blocks_reference

__all__ = ["BACKEND"]

BACKEND = MSABackend(
    name="reference",
    select_blocks=select_blocks_reference,
    attention_forward=sparse_attention_forward_reference,
    attention_backward=sparse_attention_backward_reference,
    capabilities=REFERENCE,
    unavailable_reason=lambda device: None,
    description="pure PyTorch, chunked over queries; any device and floating dtype; the oracle",
)
