"""What each MSA backend can run, as data: one frozen :class:`MSACapabilities` record per backend.

The bottom of the package with nemo_msa.limits (ADR 0017): the construction-time plan
(nemo_msa.plan), the backend records (nemo_msa.backends_*) and the kernels' launch asserts all
read these records, so that each fact ("the Triton kernels take head dims 16..128") is stated
once (ADR 0019).

- :data:`REFERENCE`: the plain-PyTorch references, the contract's whole range (nemo_msa.limits)
  and any head dim, any floating dtype (bf16/fp16 in training, fp32/fp64 in the float checks);
- :data:`TRITON`: the Triton selection, attention and fused dense indexer loss;
- :data:`FLASHINFER_PREFILL`: flashinfer's SM100/SM103 MSA prefill kernel (the flashinfer
  backend's forward; other shapes run the Triton forward, so that backend declares
  :data:`TRITON`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_msa.limits import MAX_TOP_K, SUPPORTED_BLOCK_SIZES, SUPPORTED_SCORE_TYPES

__all__ = ["FLASHINFER_PREFILL", "MSACapabilities", "REFERENCE", "TRITON"]


@dataclass(frozen=True)
class MSACapabilities:
    """What one implementation runs. Every ``why_not`` answer names the config field.

    Attributes:
        name: who runs it, for messages ("the Triton kernels").
        dtypes: q/k/v and index_q/index_k dtypes (the layer's parameter dtype).
        head_dims: attention head dims (``kv_channels``); None: any (the config's contract,
            nemo_msa.limits, still applies to layers).
        index_head_dims: indexer head dims (``msa_index_head_dim``); None: any; empty: no
            selection here.
        block_sizes: key-block sizes (``msa_block_size``).
        top_k: inclusive range of blocks per query (``msa_topk``).
        score_types: block scores of the selection (``msa_score_type``).
        max_group: most query heads per KV head, None for any.
        fused_dense_loss: the fused dense indexer loss (Triton) runs with this backend.
        fused_dense_loss_max_group: most query heads per KV head the fused loss takes.
        block_mass: the sparse forward returns the per-slot block mass and the selection the
            per-slot scores (the indexer loss from by-products, ADR 0016).
        query_subset: the ops take a subset of the queries (context parallelism's
            ``queries=``); declared for the backends that implement it.
        fused_helpers: a layer on this backend runs the fused helpers around the ops where
            their inputs allow (the one-kernel RMSNorm and RoPE, the by-product loss's Triton
            passes, the Triton recall, the per-document SDPA of the dense path); False: their
            torch references, so that the reference backend runs plain PyTorch everywhere.
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...] | None
    index_head_dims: tuple[int, ...] | None
    block_sizes: tuple[int, ...]
    top_k: tuple[int, int]
    score_types: tuple[str, ...]
    max_group: int | None = None
    fused_dense_loss: bool = False
    fused_dense_loss_max_group: int = 0
    block_mass: bool = True
    query_subset: bool = False
    fused_helpers: bool = False

    def why_not(
        self,
        *,
        dtype: torch.dtype | None = None,
        head_dim: int | None = None,
        index_head_dim: int | None = None,
        block_size: int | None = None,
        top_k: int | None = None,
        score_type: str | None = None,
        group: int | None = None,
        cp_size: int | None = None,
    ) -> str | None:
        """Why this implementation cannot run a shape, or None when it can.

        Args:
            dtype: the parameters' (q/k/v, index) dtype.
            head_dim: ``kv_channels``.
            index_head_dim: ``msa_index_head_dim``.
            block_size: ``msa_block_size``.
            top_k: ``msa_topk``.
            score_type: ``msa_score_type``.
            group: query heads per KV head (``num_attention_heads / num_query_groups``).
            cp_size: the context-parallel size; above 1 the ops run a query subset (this rank's
                queries against the gathered keys), which needs ``query_subset``.
            Absent (None) arguments are not checked.

        Returns:
            None, or one sentence naming the first field it cannot run, its value and what it
            takes.
        """
        for field, value, allowed in (
            ("msa_score_type", score_type, self.score_types),
            ("kv_channels", head_dim, self.head_dims),
            ("msa_index_head_dim", index_head_dim, self.index_head_dims),
            ("msa_block_size", block_size, self.block_sizes),
        ):
            if value is not None and allowed is not None and value not in allowed:
                return f"{field}={value!r}: {self.name} take one of {allowed}"
        low, high = self.top_k
        if top_k is not None and not low <= top_k <= high:
            return f"msa_topk={top_k}: {self.name} take {low}..{high}"
        if group is not None and self.max_group is not None and group > self.max_group:
            return (f"num_attention_heads / num_query_groups = {group} query heads per KV head: "
                    f"{self.name} take at most {self.max_group}")
        if cp_size is not None and cp_size > 1 and not self.query_subset:
            return (f"context_parallel_size={cp_size}: {self.name} take no query subset (this "
                    "rank's queries against the gathered keys)")
        if dtype is not None and dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return (f"params dtype {dtype} (model.bf16 / model.fp16): {self.name} read {names}")
        return None

    def why_not_fused_dense_loss(self, *, dtype: torch.dtype, head_dim: int,
                                 index_head_dim: int, block_size: int, group: int,
                                 score_type: str, cp_size: int = 1) -> str | None:
        """Why the fused dense indexer loss does not run with this backend and shape (then the
        chunked reference computes the same function), or None when it does."""
        if not self.fused_dense_loss:
            return f"{self.name} have no fused dense indexer loss"
        if score_type != "max":
            return f"msa_score_type={score_type!r}: the fused dense loss scores blocks by 'max'"
        if group > self.fused_dense_loss_max_group:
            return (f"{group} query heads per KV head: the fused dense loss takes at most "
                    f"{self.fused_dense_loss_max_group}")
        return self.why_not(dtype=dtype, head_dim=head_dim, index_head_dim=index_head_dim,
                            block_size=block_size, cp_size=cp_size)


REFERENCE = MSACapabilities(
    name="the reference (plain PyTorch) ops",
    dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
    # Any head dim (the ops' direct users and tests run small ones); a layer's config is held to
    # the contract's SUPPORTED_HEAD_DIMS by nemo_msa.support.MSATopology.
    head_dims=None,
    index_head_dims=None,
    block_sizes=SUPPORTED_BLOCK_SIZES,
    top_k=(1, MAX_TOP_K),
    score_types=SUPPORTED_SCORE_TYPES,
    query_subset=True,
)

_TRITON_DIMS = (16, 32, 64, 128)

TRITON = MSACapabilities(
    name="the Triton kernels",
    dtypes=(torch.bfloat16, torch.float16),
    head_dims=_TRITON_DIMS,
    index_head_dims=_TRITON_DIMS,
    block_sizes=_TRITON_DIMS,
    top_k=(1, 32),
    score_types=("max",),
    fused_dense_loss=True,
    # The fused loss's program holds 16 query tokens x the padded group in 256 rows.
    fused_dense_loss_max_group=16,
    query_subset=True,
    fused_helpers=True,
)

FLASHINFER_PREFILL = MSACapabilities(
    name="flashinfer's MSA prefill kernel",
    dtypes=(torch.bfloat16, torch.float16),
    head_dims=(128,),
    index_head_dims=(),
    block_sizes=(128,),
    top_k=(1, 16),
    score_types=(),
    max_group=16,
    block_mass=False,
)
