"""NaN/Inf containment around attention kernels that cannot mask a product themselves.

A non-finite key or value must reach exactly the queries that attend to it (issue 29; the
float64 rule is nemo_msa.testing.nonfinite's). SDPA kernels (torch's masked math path, its CPU
flash kernel, and on the GPU the flash / cuDNN tiles on the causal diagonal) multiply a masked
probability of 0 with the value of a key the query does not see, and 0 * NaN = NaN. The dense
document paths (nemo_msa.attention.dense) therefore run them on finite K and V
(:func:`finite_keys_and_values`) and set to NaN afterwards the rows that really attend a
non-finite entry (:func:`mark_attending_rows`). See docs/adr/0025-nan-containment.md.
"""

from __future__ import annotations

import torch

from nemo_msa.layout import MSAMicrobatch

__all__ = ["finite_keys_and_values", "mark_attending_rows"]


def finite_keys_and_values(
    k: torch.Tensor, v: torch.Tensor, msa: MSAMicrobatch, queries: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V with every non-finite entry replaced by 0, and the query rows that attend one.

    Causal attention within documents: query row i attends the keys of its document at
    positions <= its own, so the rows reached by a non-finite (token, KV head) are found by a
    running count of non-finite rows minus the count before the document's first row. No host
    synchronization; the cost is elementwise passes over K and V (ADR 0025).

    Args:
        k: [T, Hkv, d] compact keys.
        v: [T, Hkv, d] compact values.
        msa: the layout.
        queries: optional int64 [Tq] global compact rows of the queries.

    Returns:
        ``(k, v, reached)``: k and v in their dtypes, copies with 0 in every (token, KV head)
        row of K or V that holds a non-finite entry (gradient 0 there), and bool [Tq, Hkv]:
        the query row sees, in its document at a position <= its own, a key or value of that
        KV head that is not finite.
    """
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [T, Hkv]
    # Non-finite rows at compact rows <= t, per KV head: one flat scan of the head-major copy.
    # Each head's counts are offset by the heads before it, which the difference below
    # cancels; a scan down dim 0 of [T, Hkv] runs torch's outer-dimension kernel over Hkv
    # columns (1.4 ms at 8192 tokens and 22.9 ms at 131072 on an H100, against microseconds).
    seen = torch.cumsum(bad.t().reshape(-1), dim=0).view(bad.shape[1], -1).t()  # int64
    first = msa.cu_seqlens.long()[msa.token_documents.long()]  # the document's first row
    reached = (seen - seen[first] + bad[first]) > 0
    if queries is not None:
        reached = reached[queries]
    # Whole (token, head) rows are zeroed: their attenders are NaN anyway, and autograd keeps
    # a [T, Hkv, 1] mask rather than one of K's size. torch.where reads and writes each tensor
    # once, forward and backward; an out-of-place masked_fill is a copy and then a fill.
    hidden = bad[..., None]
    return torch.where(hidden, 0.0, k), torch.where(hidden, 0.0, v), reached


def mark_attending_rows(out: torch.Tensor, reached: torch.Tensor) -> torch.Tensor:
    """``out`` [Tq, Hq, d] with NaN in the rows of ``reached`` bool [Tq, Hkv] (query head h
    reads KV head h // (Hq / Hkv)); their gradient is 0 (a constant NaN)."""
    hq = out.shape[1]
    hkv = reached.shape[1]
    # The query heads of a KV head are adjacent: a [Tq, Hkv, 1, 1] mask broadcasts over them
    # without a per-head copy, and one torch.where reads and writes the output once. The mask
    # is made contiguous because torch.where lays its output out in the condition's dimension
    # order: finite_keys_and_values' head-major ``reached`` would give a head-major output,
    # whose flatten copies it (3 ms at 131072 tokens on an H100), and so would the backward.
    grouped = out.unflatten(1, (hkv, hq // hkv))
    mask = reached.contiguous()[:, :, None, None]
    return torch.where(mask, float("nan"), grouped).flatten(1, 2)
