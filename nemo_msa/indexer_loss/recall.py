"""The selection recall metric, measured exactly on a fixed-size sample of query rows."""

from __future__ import annotations

import contextlib
import math

import torch

from nemo_msa import unplanned
from nemo_msa.backends.capabilities import TRITON_HELPERS
from nemo_msa.indexer_loss.triton_recall import selection_recall_rows_triton
from nemo_msa.layout import query_rows
from nemo_msa.limits import accumulation_dtype

__all__ = ["sampled_selection_recall"]

@contextlib.contextmanager
def _tf32_matmul(enabled: bool):
    """fp32 CUDA matmuls on TF32 tensor cores inside the block (restored after)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = previous or enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


# Elements of one chunk's [C, Hq, W] score tensor in the sampled recall.
_RECALL_SCORE_ELEMENTS = 1 << 26


@torch.no_grad()
def sampled_selection_recall(
    query: torch.Tensor,
    key: torch.Tensor,
    q2k: torch.Tensor,
    msa,
    *,
    softmax_scale: float,
    num_rows: int,
    queries: torch.Tensor | None = None,
    fused: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Selection recall measured exactly on a fixed-size sample of query tokens.

    Estimator: the tokens ``floor((i + 1/2) * T / n)``, ``i < n = min(num_rows, T)``, evenly
    spaced over the microbatch's compact tokens (a systematic sample: every part of every
    document is represented, and ``n = T`` gives the exact recall). For each sampled token and
    local KV head the dense attention's block mass (mean over the group's query heads, within
    the document, causal) is computed, and the mass inside the selected blocks is summed. The
    mean over sampled (token, head) pairs estimates the full mean; its cost is one dense pass
    over ``n`` query rows, O(n x Hq x T) in chunks. On CUDA the scores are fp32 products of
    TF32-rounded inputs (a metric: about 1e-3 relative; fp32 FFMA would cost about 11 ms per
    layer at 131072 tokens); elsewhere exact in the accumulation dtype.

    Args:
        query: [T, Hq_local, d] main-attention queries after RoPE.
        key: [T, Hkv_local, d] main-attention keys after RoPE.
        q2k: int32 [Hkv_local, T, top_k] the selected blocks.
        msa: the microbatch layout.
        softmax_scale: the main attention's scale.
        num_rows: sample size (>= 1).
        queries: optional int64 [Tq] global compact rows of query's and q2k's tokens (a query
            subset: context parallelism; key stays every token's). The sample is then drawn
            from the Tq local tokens (each rank samples its own; the sums add over ranks, and
            ``num_rows >= Tq`` on every rank gives the exact recall of the whole microbatch).
        fused: the Triton kernel measures the sample
            (:func:`~nemo_msa.indexer_loss.triton_recall.selection_recall_rows_triton`: one pass
            per sampled row over its own document's visible keys, products of the fp16/bf16
            inputs accumulated in fp32, no [n, Hq, T] score tensor) instead of the chunked torch
            pass over the whole workspace (TF32 on CUDA). A layer passes its plan's
            :attr:`~nemo_msa.plan.MSAKernels.recall`; inputs the kernel does not take (its
            record: fp16/bf16, a Triton head dim, every token a query) are then refused. None
            chooses per call: on CUDA where the kernel takes the inputs (a direct caller;
            counted by :mod:`nemo_msa.unplanned`).

    Returns:
        ``{"recall_mass": sum of covered mass, "recall_count": sampled (token, head) pairs}``,
        scalars (fp32; fp64 for fp64 inputs), as :func:`compute_indexer_loss` reports them.

    Raises:
        ValueError: ``num_rows`` < 1, or ``fused`` on inputs the kernel does not take (naming
            ``MSAKernels.recall``).
    """
    if num_rows < 1:
        raise ValueError(f"num_rows={num_rows}; expected >= 1")
    reason = _fused_reason(query, key, queries)
    if fused is None:
        unplanned.record("recall")
        fused = query.is_cuda and reason is None
    if fused and reason is not None:
        raise ValueError(f"MSAKernels.recall=True but {reason}; the layer's plan did not "
                         "foresee these inputs")
    if fused:
        return _fused_recall(query, key, q2k, msa, softmax_scale, num_rows)
    tokens, q_heads, dim = query.shape
    heads = key.shape[1]
    group = q_heads // heads
    block = msa.block_size
    nblocks = msa.num_workspace_blocks
    device = query.device
    n = min(num_rows, tokens)
    rows = _sample_rows(n, tokens, device)
    work = accumulation_dtype(query)
    key_ws = msa.to_workspace(key.detach().to(work))  # [W, G, d]
    key_documents = msa.workspace_documents
    key_positions = msa.workspace_positions_in_document
    documents = query_rows(msa.token_documents, queries).long()[rows]
    positions = query_rows(msa.document_positions, queries).long()[rows]
    first_block = query_rows(msa.token_workspace_block_starts, queries)[rows]
    covered = torch.zeros((), dtype=work, device=device)
    chunk = max(1, _RECALL_SCORE_ELEMENTS // max(1, q_heads * msa.workspace_size))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        count = stop - start
        visible = (key_documents[None, :] == documents[start:stop, None]) & (
            key_positions[None, :] <= positions[start:stop, None]
        )
        qc = query[rows[start:stop]].detach().to(work).view(count, heads, group, dim)
        with _tf32_matmul(query.is_cuda and work == torch.float32):
            scores = torch.einsum("cgqd,wgd->cgqw", qc, key_ws) * softmax_scale
        scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
        probs = torch.softmax(scores, dim=-1).sum(dim=2) / group  # [C, G, W]
        target = probs.view(count, heads, nblocks, block).sum(dim=-1)  # [C, G, NB]
        selected = q2k[:, rows[start:stop]].long()  # [G, C, K]
        block_ids = first_block[start:stop][None, :, None] + selected.clamp(min=0)
        mass = target.permute(1, 0, 2).gather(-1, block_ids)
        covered += torch.where(selected >= 0, mass, 0.0).sum()
    return {
        "recall_mass": covered,
        "recall_count": torch.full((), float(n * heads), dtype=work, device=device),
    }




def _sample_rows(n: int, tokens: int, device: torch.device) -> torch.Tensor:
    """int64 [n]: the evenly spaced sample ``floor((i + 0.5) * tokens / n)``, i < n, as
    ``(2i + 1) * tokens // (2n)`` in exact integer arithmetic (two kernels)."""
    return torch.arange(tokens, 2 * n * tokens, 2 * tokens, device=device) // (2 * n)


def _fused_reason(query: torch.Tensor, key: torch.Tensor,
                  queries: torch.Tensor | None) -> str | None:
    """Why the Triton recall cannot run these inputs (None when it can): its record,
    :data:`~nemo_msa.backends.capabilities.TRITON_HELPERS`' ``recall``."""
    if key.dtype != query.dtype:
        return f"query/key dtypes {query.dtype}/{key.dtype} differ"
    return TRITON_HELPERS.recall.why_not(dtype=query.dtype, dim=query.shape[-1],
                                         query_subset=queries is not None)


def _fused_recall(query, key, q2k, msa, softmax_scale: float, num_rows: int) -> dict:
    """The sampled recall on :func:`selection_recall_rows_triton` (the same sample)."""
    tokens = query.shape[0]
    n = min(num_rows, tokens)
    # The same sample for every layer of the microbatch: built once, kept on the layout.
    rows = msa.cached(f"recall_sample_rows_{n}", lambda: _sample_rows(n, tokens, query.device))
    covered = selection_recall_rows_triton(
        query.detach(), key.detach(), q2k[:, rows], rows, msa, softmax_scale)
    return {
        "recall_mass": covered.sum(),
        "recall_count": torch.full((), float(n * key.shape[1]), device=query.device),
    }
