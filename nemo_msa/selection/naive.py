"""Reference block selection in plain PyTorch: the oracle of every selection kernel.

For index head h and a query token at document-local position p (own block o = p // B):
candidates are blocks 0..o of its document (block o only keys <= p); score(b) is the max (or
log-sum-exp) over visible keys of q_h(p) . k(j); forced blocks (b < init_blocks, or
o - local_blocks < b <= o) are always chosen and count inside top_k; the rest go by score, ties
to the lower block id, NaN last. The output is canonical: ascending ids, -1 at the tail.

Memory stays bounded: queries are processed in chunks, each scoring against the aligned
workspace (one [H, chunk, W] product, reduced to [H, chunk, W / B] block scores at once).
"""

from __future__ import annotations

import math

import torch

from nemo_msa.layout import MSAMicrobatch, query_rows
from nemo_msa.limits import accumulation_dtype

# Elements of one chunk's [H, chunk, W] score tensor; bounds the reference's peak memory.
_SCORE_ELEMENTS_PER_CHUNK = 1 << 25


def select_blocks_reference(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    msa: MSAMicrobatch,
    *,
    top_k: int,
    init_blocks: int,
    local_blocks: int,
    score: str = "max",
    queries: torch.Tensor | None = None,
):
    """Top-k block selection, reference implementation.

    Args:
        index_q: [T, H, d] float (bf16/fp16/fp32/fp64) index queries ([Tq, H, d] with
            ``queries``).
        index_k: [T, d] float, the one shared index key head (always every token).
        msa: layout of the batch.
        top_k: blocks per query.
        init_blocks: forced sink blocks at each document start.
        local_blocks: forced blocks ending at the query's own block.
        score: ``"max"`` or ``"lse"`` (log-sum-exp of q.k / sqrt(d)).
        queries: optional int64 [Tq], the global compact rows of index_q's tokens (a query
            subset, ascending; context parallelism); None = every token.

    Returns:
        int32 [H, T, top_k] ([H, Tq, top_k] with ``queries``), ascending document-local block
        ids, -1 at the tail.
    """
    tokens, heads, dim = index_q.shape
    block = msa.block_size
    nblocks = msa.num_workspace_blocks
    dtype = accumulation_dtype(index_q)
    device = index_q.device

    keys = msa.to_workspace(index_k.to(dtype))  # [W, d], zero rows past document ends
    key_documents = msa.workspace_documents  # [W], -1 past ends
    # Block-level facts: every block holds at least its first row, which is real.
    block_documents = key_documents[::block]  # [NB]
    # Rows past a document end are never visible (masked_fill keeps this free of host syncs).
    key_bias = torch.zeros(msa.workspace_size, dtype=dtype, device=device).masked_fill(
        key_documents < 0, -math.inf
    )
    block_ids = torch.arange(nblocks, device=device)

    positions = query_rows(msa.document_positions, queries).long()
    documents = query_rows(msa.token_documents, queries).long()
    first_block = query_rows(msa.token_workspace_block_starts, queries)  # [T] (or [Tq])
    scale = 1.0 / math.sqrt(dim)

    chunk = max(1, _SCORE_ELEMENTS_PER_CHUNK // max(1, heads * msa.workspace_size))
    out = torch.empty(heads, tokens, top_k, dtype=torch.int32, device=device)
    for start in range(0, tokens, chunk):
        stop = min(tokens, start + chunk)
        q = index_q[start:stop].to(dtype)  # [C, H, d]
        p = positions[start:stop]
        own = p // block  # [C]
        own_block = first_block[start:stop] + own  # workspace id of the own block

        scores = torch.einsum("chd,wd->hcw", q, keys)
        if score == "lse":
            scores = scores * scale
        scores = scores + key_bias
        # The own block is visible only up to the query itself; earlier blocks are whole.
        key_rows = own_block[:, None] * block + torch.arange(block, device=device)  # [C, B]
        own_scores = torch.einsum("chd,cbd->hcb", q, keys[key_rows])
        if score == "lse":
            own_scores = own_scores * scale
        hidden = torch.arange(block, device=device)[None, :] > (p % block)[:, None]
        own_scores = own_scores.masked_fill(hidden, -math.inf)
        if score == "max":
            block_scores = scores.view(heads, -1, nblocks, block).amax(dim=-1)
            own_value = own_scores.amax(dim=-1)
        else:
            block_scores = torch.logsumexp(scores.view(heads, -1, nblocks, block), dim=-1)
            own_value = torch.logsumexp(own_scores, dim=-1)
        block_scores.scatter_(2, own_block.view(1, -1, 1).expand(heads, -1, 1),
                              own_value.unsqueeze(-1))

        local = block_ids[None, :] - first_block[start:stop, None]  # [C, NB] doc-local id
        candidate = (block_documents[None, :] == documents[start:stop, None]) & (
            local <= own[:, None]
        )
        forced = candidate & (
            (local < init_blocks) | (local > own[:, None] - local_blocks)
        )
        ids = _rank(block_scores, candidate, forced, local, top_k)
        out[:, start:stop] = ids
    return out


def _rank(
    scores: torch.Tensor,
    candidate: torch.Tensor,
    forced: torch.Tensor,
    local: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Ranks blocks: forced first, then candidates by score (NaN last, ties to lower id).

    Args:
        scores: [H, C, NB] block scores.
        candidate: bool [C, NB].
        forced: bool [C, NB].
        local: int64 [C, NB] document-local block id of each workspace block.
        top_k: how many to keep.

    Returns:
        int32 [H, C, top_k] canonical support.
    """
    heads = scores.shape[0]
    nblocks = scores.shape[-1]
    # NaN ranks below every real score but stays above non-candidates (a separate tier).
    keyed = torch.nan_to_num(scores, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    tier = candidate.to(torch.int8) + forced.to(torch.int8)  # 2 forced, 1 candidate, 0 none
    # Two stable sorts give a lexicographic order (tier, score) with ties kept in block order.
    by_score = torch.sort(keyed, dim=-1, descending=True, stable=True).indices
    tier_in_order = tier.expand(heads, -1, -1).gather(-1, by_score)
    nan_in_order = torch.isnan(scores).gather(-1, by_score)
    # Within a tier NaN must follow -inf; fold it in as a half step below the tier.
    rank_key = tier_in_order.to(torch.int16) * 2 - nan_in_order.to(torch.int16)
    order = torch.sort(rank_key, dim=-1, descending=True, stable=True).indices
    chosen = by_score.gather(-1, order)[..., : min(top_k, nblocks)]
    chosen_tier = tier.expand(heads, -1, -1).gather(-1, chosen)
    chosen_local = local.expand(heads, -1, -1).gather(-1, chosen)
    ids = torch.where(chosen_tier > 0, chosen_local, -1)
    if ids.shape[-1] < top_k:
        pad = ids.new_full((*ids.shape[:-1], top_k - ids.shape[-1]), -1)
        ids = torch.cat([ids, pad], dim=-1)
    # Canonical: ascending ids, -1 at the tail.
    big = torch.iinfo(torch.int64).max
    ids = torch.sort(torch.where(ids < 0, big, ids), dim=-1).values
    return torch.where(ids == big, -1, ids).to(torch.int32)
