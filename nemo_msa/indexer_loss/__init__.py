"""The indexer's distillation loss: the plain-PyTorch reference beside its fused paths."""

from nemo_msa.indexer_loss.byproducts import sparse_indexer_loss_from_byproducts
from nemo_msa.indexer_loss.naive import compute_indexer_loss
from nemo_msa.indexer_loss.recall import sampled_selection_recall
from nemo_msa.indexer_loss.triton_dense import dense_indexer_loss_triton

__all__ = [
    "compute_indexer_loss",
    "dense_indexer_loss_triton",
    "sampled_selection_recall",
    "sparse_indexer_loss_from_byproducts",
]
