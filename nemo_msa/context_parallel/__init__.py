"""Context parallelism for MSA layers (docs/adr/0020-context-parallelism.md)."""

from nemo_msa.context_parallel.comm import gather_from_context_parallel
from nemo_msa.context_parallel.indices import (
    gather_order,
    load_balanced_indices,
    split_for_context_parallel,
    thd_load_balanced_indices,
)
from nemo_msa.context_parallel.layout import ContextParallelLayout, thd_document_map

__all__ = [
    "ContextParallelLayout",
    "gather_from_context_parallel",
    "gather_order",
    "load_balanced_indices",
    "split_for_context_parallel",
    "thd_document_map",
    "thd_load_balanced_indices",
]
