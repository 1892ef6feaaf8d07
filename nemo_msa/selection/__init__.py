"""Block selection: index scorer + top-k, no gradient."""

from __future__ import annotations

import torch

from nemo_msa.backends import resolve_backend
from nemo_msa.layout import MSAMicrobatch
from nemo_msa.q2k import mark_canonical
from nemo_msa.support import (
    MAX_TOP_K,
    SUPPORTED_SCORE_TYPES,
    reject_cuda_graph_capture,
    require_integer,
)

__all__ = ["select_blocks", "validate_selection_inputs"]


def validate_selection_inputs(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    msa: MSAMicrobatch,
    top_k: int,
    score: str,
) -> None:
    """Checks selection inputs before dispatch.

    Raises:
        ValueError: names the argument, its value and what was expected.
    """
    if not index_q.dtype.is_floating_point or index_q.dim() != 3:
        raise ValueError(
            f"index_q must be a float tensor [tokens, index_heads, dim]; got {index_q.dtype} "
            f"{tuple(index_q.shape)}"
        )
    if index_k.dtype != index_q.dtype or index_k.dim() != 2:
        raise ValueError(
            f"index_k must be [tokens, dim] with index_q's dtype {index_q.dtype}; got "
            f"{index_k.dtype} {tuple(index_k.shape)}"
        )
    if index_q.shape[0] != msa.num_tokens or index_k.shape[0] != msa.num_tokens:
        raise ValueError(
            f"index_q {tuple(index_q.shape)} and index_k {tuple(index_k.shape)} must have "
            f"tokens={msa.num_tokens} rows (the layout's num_tokens)"
        )
    if index_k.shape[1] != index_q.shape[2]:
        raise ValueError(
            f"index_k dim {index_k.shape[1]} != index_q dim {index_q.shape[2]}"
        )
    if index_q.device != msa.device or index_k.device != msa.device:
        raise ValueError(
            f"index_q ({index_q.device}), index_k ({index_k.device}) and the layout "
            f"({msa.device}) must share one device"
        )
    require_integer("top_k", top_k)
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k={top_k}; expected 1 <= top_k <= {MAX_TOP_K}")
    if score not in SUPPORTED_SCORE_TYPES:
        raise ValueError(f"score={score!r}; expected one of {SUPPORTED_SCORE_TYPES}")
    init_blocks, local_blocks = msa.forced_blocks
    if init_blocks + local_blocks > top_k:
        raise ValueError(
            f"init_blocks + local_blocks = {init_blocks} + {local_blocks} exceeds top_k={top_k}; "
            "forced blocks count inside the top-k"
        )


@torch.no_grad()
def select_blocks(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    msa: MSAMicrobatch,
    *,
    top_k: int = 16,
    score: str = "max",
    backend: str | None = None,
    return_scores: bool = False,
):
    """Chooses top_k key blocks per index head and query token, inside the query's document.

    Forced blocks (``msa.forced_blocks`` = (init_blocks, local_blocks)) are always chosen and
    count inside top_k; the rest go by the block score (max of q.k over the block's causally
    visible keys), ties to the lower block id, NaN last.

    Args:
        index_q: [T, H, d] float (bf16 in production) index queries; head h serves KV head h.
        index_k: [T, d] the one shared index key head, index_q's dtype.
        msa: the batch layout.
        top_k: blocks per query, 1..32.
        score: ``"max"`` or ``"lse"``.
        backend: backend name or "auto"/None.
        return_scores: also return the indexer loss's by-products of the same pass, per slot:
            the block's real score (fp32 [H, T, top_k], the unscaled max of q.k over its visible
            keys, forced blocks included, -inf at -1 slots) and the compact row of the key that
            attains it (int32 [H, T, top_k], -1 at -1 slots). ``score="max"`` only.

    Returns:
        int32 [H, T, top_k]: ascending document-local block ids, padded with -1 at the tail when
        fewer than top_k blocks exist. Canonical: equal across correct implementations on inputs
        without ties. With ``return_scores``: ``(ids, scores, keys)``.

    Raises:
        ValueError: a bad argument (named), or ``return_scores`` with ``score="lse"``.
    """
    validate_selection_inputs(index_q, index_k, msa, top_k, score)
    if return_scores and score != "max":
        raise ValueError(
            f"return_scores=True needs score='max' (the block max and the key attaining it); "
            f"got score={score!r}"
        )
    reject_cuda_graph_capture("select_blocks")
    chosen = resolve_backend(
        backend, index_q.device, score_type=score, index_head_dim=index_q.shape[-1],
        block_size=msa.block_size, top_k=top_k, dtype=index_q.dtype,
    )
    init_blocks, local_blocks = msa.forced_blocks
    result = chosen.select_blocks(
        index_q.contiguous(),
        index_k.contiguous(),
        msa,
        top_k=top_k,
        init_blocks=init_blocks,
        local_blocks=local_blocks,
        score=score,
        **({"return_scores": True} if return_scores else {}),
    )
    # Canonical by construction: sparse_attention takes it as it is.
    mark_canonical(result[0] if return_scores else result, msa.block_size)
    return result
