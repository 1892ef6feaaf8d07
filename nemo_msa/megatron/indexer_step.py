"""What the indexer does in one forward of an MSA layer, and the loss that forward attaches.

:class:`IndexerStep` is the per-forward part of the decision (training or not, gradient or the
first pass of a full recompute, the dense warm-up); everything decided once is the layer's
:class:`nemo_msa.plan.MSAPlan`: the loss's route (the sparse loss from the attention's
by-products, ADR 0016 / 0033; the fused dense loss, ADR 0018; else the chunked reference),
the topology and the helpers' kernels. :func:`indexer_loss` computes the loss by that route.
Neither reads a config field the plan holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_msa.indexer_loss import (
    compute_indexer_loss,
    dense_indexer_loss_triton,
    sampled_selection_recall,
    sparse_indexer_loss_from_byproducts,
)
from nemo_msa.megatron.phase import dense_warmup_active
from nemo_msa.plan import MSAPlan
from nemo_msa.q2k import Selection
from nemo_msa.query_view import QueryView

__all__ = ["IndexerStep", "indexer_loss"]


@dataclass(frozen=True)
class IndexerStep:
    """The indexer's part in one layer forward.

    Attributes:
        sparse: attention runs over the selected blocks (an MSA layer past the dense warm-up).
        trains: the indexer trains in this step: the forward runs the kernels (and keeps the
            by-products) of a training forward. Also true in the no-grad first pass of a full
            recompute, whose recompute attaches the loss.
        need_loss: the loss is computed and attached in this forward (``trains`` with grad).
        log_recall: the selection recall is measured with the loss (``msa_log_selection_recall``);
            during the dense warm-up the selection then runs for the metric alone.
        byproducts: the sparse forward returns its block mass, the loss's target (the plan's
            ``loss_route`` "byproducts", in a sparse training step).
    """

    sparse: bool
    trains: bool
    need_loss: bool
    log_recall: bool
    byproducts: bool

    @classmethod
    def of(
        cls, plan: MSAPlan, config: Any, *, is_msa_layer: bool, training: bool, recording: bool
    ) -> IndexerStep:
        """The step of one forward.

        Args:
            plan: the layer's plan.
            config: the layer's config (the loss coefficient, the recall switch, the warm-up).
            is_msa_layer: the layer has an indexer (False: a dense layer of a mixed pattern).
            training: the module's training flag.
            recording: the no-grad first forward of a full recompute (selection replay).

        Returns:
            The step.
        """
        trains = (
            is_msa_layer
            and training
            and (torch.is_grad_enabled() or recording)
            and config.msa_indexer_loss_coeff > 0
        )
        need_loss = trains and torch.is_grad_enabled()
        sparse = is_msa_layer and not dense_warmup_active(config)
        return cls(
            sparse=sparse,
            trains=trains,
            need_loss=need_loss,
            log_recall=need_loss and bool(config.msa_log_selection_recall),
            byproducts=trains and sparse and plan.loss_route == "byproducts",
        )

    @property
    def indexes(self) -> bool:
        """The indexer runs (index_q / index_k are needed)."""
        return self.sparse or self.need_loss

    @property
    def selects(self) -> bool:
        """The selection runs (for the attention, or for the recall metric alone)."""
        return self.sparse or self.log_recall


def indexer_loss(
    plan: MSAPlan,
    step: IndexerStep,
    config: Any,
    *,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    selection: Selection | None,
    block_mass: torch.Tensor | None,
    view: QueryView,
    softmax_scale: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The indexer loss of one forward, by the plan's route (:attr:`MSAPlan.loss_route` past the
    dense warm-up, :attr:`MSAPlan.warmup_loss_route` during it):

    - ``"byproducts"``: the sparse loss from the attention's block mass
      (:func:`~nemo_msa.indexer_loss.sparse_indexer_loss_from_byproducts`, its passes in Triton
      where the plan's ``kernels.loss_passes`` says), the recall on a sample of rows
      (:func:`~nemo_msa.indexer_loss.sampled_selection_recall`, ``kernels.recall``);
    - ``"fused_dense"``: :func:`~nemo_msa.indexer_loss.dense_indexer_loss_triton`;
    - ``"reference_sparse"`` / ``"reference_dense"``: the chunked reference,
      :func:`~nemo_msa.indexer_loss.compute_indexer_loss`.

    Args:
        plan: the layer's plan.
        step: this forward's :class:`IndexerStep` (``need_loss`` true).
        config: the layer's config (``msa_indexer_loss_coeff``, ``msa_recall_sample_rows``,
            ``msa_indexer_loss_query_chunk``).
        index_q: [Tq, H_local, d_idx] index queries (with gradient).
        index_k: [T, d_idx] the shared index key (with gradient).
        query: [Tq, Hq_local, d] main-attention queries after RoPE.
        key: [T, Hkv_local, d] main-attention keys after RoPE (every token's).
        selection: the selection (q2k int32 [H_local, Tq, top_k]), or None (none ran).
        block_mass: the sparse forward's mass per selected slot (``step.byproducts``), or None.
        view: the microbatch layout with this rank's queries (context parallelism).
        softmax_scale: the main attention's scale.

    Returns:
        ``(loss, stats)``: the scaled loss and the metrics to record.
    """
    topology = plan.topology
    msa, queries = view.msa, view.queries
    common = dict(
        num_index_heads_total=topology.num_index_heads,
        loss_coeff=config.msa_indexer_loss_coeff,
        queries=queries,
    )
    q2k = None if selection is None else selection.q2k
    route = plan.loss_route if step.sparse else plan.warmup_loss_route
    if route == "byproducts":
        loss, stats = sparse_indexer_loss_from_byproducts(
            index_q, index_k, q2k, block_mass, msa, fused=plan.kernels.loss_passes, **common
        )
        if step.log_recall:
            stats.update(sampled_selection_recall(
                query, key, q2k, msa, softmax_scale=softmax_scale,
                num_rows=config.msa_recall_sample_rows, queries=queries,
                fused=plan.kernels.recall,
            ))
        return loss, stats
    recall_q2k = q2k if step.log_recall else None
    if route == "fused_dense":
        return dense_indexer_loss_triton(
            index_q, index_k, query, key, msa, softmax_scale=softmax_scale, q2k=recall_q2k,
            **common,
        )
    sparse_loss = route == "reference_sparse"
    return compute_indexer_loss(
        index_q, index_k, query, key, msa, softmax_scale=softmax_scale,
        score_type=topology.score_type, q2k=q2k if sparse_loss else recall_q2k,
        query_chunk=config.msa_indexer_loss_query_chunk, sparse=sparse_loss, **common,
    )
