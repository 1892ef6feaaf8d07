"""Conversions between this project's MSA layout and flashinfer's MSA prefill kernel.

flashinfer (0.7.2) ships ``flashinfer.msa_ops.msa_sparse_attention``, the MiniMax sparse
attention forward for compute capability 10.0/10.3 (and 12.x). Every conversion between its
arguments and this project's compact layout lives here, so that the backend
(:mod:`nemo_msa.backends.flashinfer`) only dispatches:

- sequences: flashinfer's "sequence" is one document. ``cu_seqlens_q`` and ``cu_seqlens_k`` are
  both the layout's ``cu_seqlens`` (int32 [D + 1]); q, k and v are the compact tokens, flat
  (not paged) and contiguous; ``causal=True`` and ``q_offset=None`` (query i of a sequence sits
  at key position i, because the query and key lengths of every sequence are equal).
- block ids: flashinfer's ``q2k_indices`` holds per-sequence block ids of 128 tokens; with one
  sequence per document these are the document-local ids of this project, unchanged. The
  orientation is the same too ([Hkv, T, top_k]).
- q2k form: flashinfer takes ``top_k == 16`` ids per row, ascending and padded with -1 at the
  tail. This project gives any q2k the meaning of the *set* of its entries that lie in
  0..own block (MSA_SPEC.md), so :func:`to_flashinfer_q2k` keeps exactly those, removes
  duplicates, sorts them, pads with -1 and widens the row to 16 columns.
- head order: both put query head h on KV head ``h // (Hq / Hkv)``; nothing to convert.
- lse: flashinfer returns the natural-log LSE as fp32 [T, Hq]; this project keeps fp32
  [Hq, T], natural log (:func:`from_flashinfer_lse` transposes).
- a query whose row selects no block: out 0 and lse -inf, as this project's reference. The
  docstring does not say; flashinfer 0.7.2's code does it (the SM12x path fills its outputs
  with 0 / -inf, the SM100 kernels scale by 0 and write -inf for an empty sum), and the SM100
  test of this adapter checks it on the hardware.

flashinfer itself is imported only by :func:`load_msa_sparse_attention`, on first use; tests
replace that function with a CPU double.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_msa.backends.capabilities import FLASHINFER_PREFILL
from nemo_msa.layout import MSAMicrobatch
from nemo_msa.q2k import canonical_q2k

__all__ = [
    "FLASHINFER_BLOCK_SIZE",
    "FLASHINFER_HEAD_DIM",
    "FLASHINFER_MAX_GROUP",
    "FLASHINFER_TOP_K",
    "flashinfer_attention_forward",
    "flashinfer_cu_seqlens",
    "from_flashinfer_lse",
    "load_msa_sparse_attention",
    "to_flashinfer_q2k",
    "unsupported_shape_reason",
]

# What the SM100/SM103 kernels take is the record
# nemo_msa.backends.capabilities.FLASHINFER_PREFILL; the names below are its fields, for the
# layout conversion.
#: Tokens per KV block in flashinfer's MSA kernels (fixed).
FLASHINFER_BLOCK_SIZE = FLASHINFER_PREFILL.block_sizes[0]
#: The only head dim of the SM100/SM103 kernels.
FLASHINFER_HEAD_DIM = FLASHINFER_PREFILL.head_dims[0]
#: Selected blocks per row the SM100/SM103 kernels take (exactly this many columns).
FLASHINFER_TOP_K = FLASHINFER_PREFILL.top_k[1]
#: Largest GQA group (query heads per KV head) of the SM100/SM103 kernels.
FLASHINFER_MAX_GROUP = FLASHINFER_PREFILL.max_group


def load_msa_sparse_attention() -> Callable:
    """Imports flashinfer's MSA prefill entry on first use (the adapter's only import of it).

    Returns:
        ``flashinfer.msa_ops.msa_sparse_attention``.

    Raises:
        ImportError: flashinfer (or a dependency of its msa_ops) is not installed.
    """
    from flashinfer.msa_ops import msa_sparse_attention

    return msa_sparse_attention


def unsupported_shape_reason(
    q: torch.Tensor, k: torch.Tensor, q2k: torch.Tensor, msa: MSAMicrobatch
) -> str | None:
    """Says why flashinfer's SM100/SM103 kernel cannot take these shapes, or None if it can.

    Shapes only (no data, no host synchronization); the caller has validated the inputs
    (``nemo_msa.ops.validate_attention_inputs``).

    Args:
        q: [T, Hq, d] queries.
        k: [T, Hkv, d] keys.
        q2k: int32 [Hkv, T, top_k] selected blocks.
        msa: the layout (its ``block_size``).

    Returns:
        None, or one sentence naming the first unsupported value and what the kernel needs.
    """
    return FLASHINFER_PREFILL.why_not(dtype=q.dtype, head_dim=q.shape[-1],
                                      block_size=msa.block_size, top_k=q2k.shape[-1],
                                      group=q.shape[1] // k.shape[1])


def to_flashinfer_q2k(q2k: torch.Tensor, msa: MSAMicrobatch, canonical: bool = False
                      ) -> torch.Tensor:
    """The q2k flashinfer takes: the same set of blocks in its canonical 16-column form.

    A row keeps exactly the entries that are document-local block ids in 0..own block (the
    entries that count in this project, MSA_SPEC.md); they are deduplicated, sorted ascending
    and followed by -1. Canonical input (``select_blocks``) comes back unchanged apart from the
    extra -1 columns. No host synchronization.

    Args:
        q2k: int32 [Hkv, T, top_k], top_k <= 16: document-local block ids; any values.
        msa: the layout (``document_positions`` int32 [T], ``block_size``).
        canonical: the caller knows q2k is canonical (a :class:`~nemo_msa.q2k.Selection`'s
            flag): it is only widened.

    Returns:
        int32 [Hkv, T, 16], contiguous: ascending distinct ids in 0..own block, -1 at the tail.

    Raises:
        ValueError: q2k is not int32 [Hkv, T, top_k] with top_k <= 16.
    """
    if q2k.dtype != torch.int32 or q2k.dim() != 3 or q2k.shape[1] != msa.num_tokens:
        raise ValueError(f"q2k must be int32 [Hkv, T={msa.num_tokens}, top_k]; got {q2k.dtype} "
                         f"{tuple(q2k.shape)}")
    if q2k.shape[2] > FLASHINFER_TOP_K:
        raise ValueError(f"q2k has top_k={q2k.shape[2]} columns; flashinfer takes at most "
                         f"{FLASHINFER_TOP_K}")
    ids = q2k if canonical else canonical_q2k(q2k, msa)
    missing = FLASHINFER_TOP_K - ids.shape[-1]
    if missing:
        ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], missing), -1)], dim=-1)
    return ids.contiguous()


def flashinfer_cu_seqlens(msa: MSAMicrobatch) -> torch.Tensor:
    """flashinfer's ``cu_seqlens_q`` and ``cu_seqlens_k``: one sequence per document.

    Args:
        msa: the layout.

    Returns:
        int32 [D + 1], contiguous, on the layout's device: compact start of each document,
        then T (the layout's ``cu_seqlens``; no copy when it already has that form).
    """
    return msa.cu_seqlens.to(torch.int32).contiguous()


def from_flashinfer_lse(lse: torch.Tensor, num_heads: int, num_tokens: int) -> torch.Tensor:
    """flashinfer's LSE in this project's convention.

    Args:
        lse: fp32 [T, Hq], natural log (``return_softmax_lse=True``).
        num_heads: Hq.
        num_tokens: T.

    Returns:
        fp32 [Hq, T], contiguous, natural log; -inf stays -inf.

    Raises:
        ValueError: lse is not fp32 [T, Hq].
    """
    if lse.dtype != torch.float32 or tuple(lse.shape) != (num_tokens, num_heads):
        raise ValueError(f"flashinfer's lse must be fp32 [T={num_tokens}, Hq={num_heads}]; got "
                         f"{lse.dtype} {tuple(lse.shape)}")
    return lse.t().contiguous()


def flashinfer_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q2k: torch.Tensor,
    msa: MSAMicrobatch,
    softmax_scale: float,
    canonical: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MSA attention forward by flashinfer's ``msa_sparse_attention``.

    Args:
        q: bf16/fp16 [T, Hq, 128] queries, compact tokens.
        k: q's dtype [T, Hkv, 128] keys; Hq is a multiple of Hkv, Hq / Hkv <= 16.
        v: q's dtype [T, Hkv, 128] values.
        q2k: int32 [Hkv, T, top_k], top_k <= 16: document-local block ids (any values; the set
            of ids in 0..own block counts).
        msa: the layout; ``block_size`` must be 128.
        softmax_scale: multiplies q.k before the softmax.
        canonical: q2k is known to be canonical (:func:`to_flashinfer_q2k`).

    Returns:
        ``(out, lse)``: out in q's dtype [T, Hq, 128]; lse fp32 [Hq, T], natural log (-inf
        where a query selected no block).

    Raises:
        ValueError: shapes or dtypes the kernel cannot take (see
            :func:`unsupported_shape_reason`), or inputs that disagree.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [T, Hq, d] and k, v one [T, Hkv, d] shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[0] != msa.num_tokens or k.shape[0] != msa.num_tokens:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the layout's "
                         f"T={msa.num_tokens} tokens")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: Hq must be a multiple of "
                         f"Hkv and the head dims equal")
    if q2k.dim() != 3 or q2k.shape[0] != k.shape[1]:
        raise ValueError(f"q2k {tuple(q2k.shape)} must be [Hkv={k.shape[1]}, T, top_k]")
    reason = unsupported_shape_reason(q, k, q2k, msa)
    if reason is not None:
        raise ValueError(f"flashinfer backend: {reason}")
    msa_sparse_attention = load_msa_sparse_attention()
    cu_seqlens = flashinfer_cu_seqlens(msa)
    out, lse = msa_sparse_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), to_flashinfer_q2k(q2k, msa, canonical),
        cu_seqlens, cu_seqlens, causal=True, softmax_scale=float(softmax_scale),
        return_softmax_lse=True,
    )
    return out, from_flashinfer_lse(lse, q.shape[1], q.shape[0])
