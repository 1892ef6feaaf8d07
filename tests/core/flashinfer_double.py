"""A CPU test double of ``flashinfer.msa_ops.msa_sparse_attention`` (flashinfer 0.7.2).

Written from the function's docstring, not its code; the numbers come from this project's
reference (``nemo_msa.attention.naive``). Every precondition is checked before anything is
computed, and a violation raises :class:`FlashinferContractError` (an AssertionError, so no
``except ValueError`` in the code under test can swallow it).

Preconditions, by source:

- docstring: q bf16/fp16 ``(total_q, num_qo_heads, head_dim)``; flat k/v
  ``(total_k, num_kv_heads, head_dim)`` in q's dtype (fp8 / NVFP4 not modelled); q2k_indices
  int32 ``(num_kv_heads, total_q, topk)``, "sorted ascending and padded with -1"; on compute
  capability 10.0/10.3 ``topk == 16``; cu_seqlens_q / cu_seqlens_k int32 ``(batch_size + 1,)``
  (cumulative lengths: start at 0, never decrease, end at total_q / total_k); cu_seqlens_k
  required on the flat path; the LSE comes back natural-log, fp32 ``(total_q, num_qo_heads)``.
- the SM100/SM103 wrapper's argument checks (not in the docstring): head_dim 128, contiguous
  q/k/v/q2k_indices, at least one query, GQA group (num_qo_heads / num_kv_heads) in 1..16.
- this project's adapter promises more than flashinfer asks, and the double holds it to that:
  ids strictly ascending (distinct), each below its sequence's block count, and every tensor
  on q's device.

Semantics (docstring, and flashinfer's trace reference of the op): query i of sequence b
(position ``i - cu_seqlens_q[b]``) and query head h attend, in KV head ``h // group``, the keys
of the blocks its row selects (block j = keys ``128 j .. 128 j + 127`` of the sequence); causal
masking keeps keys at positions <= the query's (q_offset None and equal query/key lengths). A
query with no visible key gets zeros and lse -inf. Only causal, flat bf16/fp16 calls without
K/V scales and with ``q_offset=None`` are modelled; anything else raises NotImplementedError.
"""

from __future__ import annotations

import math

import torch

from nemo_msa.attention.naive import sparse_attention_forward_reference
from nemo_msa.layout import MSAMicrobatch

BLOCK = 128
HEAD_DIM = 128
TOP_K = 16


class FlashinferContractError(AssertionError):
    """A call that breaks a precondition of flashinfer's msa_sparse_attention."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise FlashinferContractError(message)


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, device: torch.device) -> list:
    _require(isinstance(cu, torch.Tensor), f"{name} must be a tensor")
    _require(cu.dtype == torch.int32, f"{name} must be int32, got {cu.dtype}")
    _require(cu.dim() == 1 and cu.numel() >= 2, f"{name} must be (batch_size + 1,), got "
             f"{tuple(cu.shape)}")
    _require(cu.device == device, f"{name} is on {cu.device}, q on {device}")
    values = cu.tolist()
    _require(values[0] == 0, f"{name}[0] must be 0, got {values[0]}")
    _require(all(b >= a for a, b in zip(values, values[1:], strict=False)),
             f"{name} must not decrease: {values}")
    _require(values[-1] == total, f"{name}[-1] = {values[-1]} must equal {total}")
    return values


def _check_q2k(q2k: torch.Tensor, cu: list, hkv: int, total_q: int, device) -> None:
    _require(isinstance(q2k, torch.Tensor) and q2k.dtype == torch.int32,
             f"q2k_indices must be int32, got {getattr(q2k, 'dtype', type(q2k))}")
    _require(q2k.dim() == 3 and tuple(q2k.shape[:2]) == (hkv, total_q),
             f"q2k_indices must be (num_kv_heads={hkv}, total_q={total_q}, topk), got "
             f"{tuple(q2k.shape)}")
    _require(q2k.shape[2] == TOP_K, f"topk must be {TOP_K} on SM100/SM103, got {q2k.shape[2]}")
    _require(q2k.is_contiguous(), "q2k_indices must be contiguous")
    _require(q2k.device == device, f"q2k_indices is on {q2k.device}, q on {device}")
    ids = q2k.long().cpu()
    selected = ids >= 0
    _require(bool((selected | (ids == -1)).all()), "q2k_indices holds a negative id other than -1")
    # -1 only as tail padding: once a row has a -1, everything after it is -1.
    _require(not bool((selected[..., 1:] & ~selected[..., :-1]).any()),
             "q2k_indices has a block id after a -1 (the -1s must pad the tail)")
    ascending = (ids[..., 1:] > ids[..., :-1]) | ~selected[..., 1:]
    _require(bool(ascending.all()),
             "q2k_indices ids must be strictly ascending along topk (sorted, no repeats)")
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:], strict=False)])
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [total_q]
    blocks = (lengths[sequence] + BLOCK - 1) // BLOCK  # blocks of each query's sequence
    _require(not bool((ids >= blocks[None, :, None]).any()),
             "q2k_indices holds a block id past its sequence's last block")


def msa_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q2k_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    page_table=None,
    seqused_k=None,
    return_softmax_lse: bool = False,
    k_scale=None,
    v_scale=None,
    k_global_scale=None,
    v_global_scale=None,
    q_offset=None,
    return_temperature_lse: bool = False,
    lse_temperature_scale: float = 1.0,
    workspace=None,
):
    """The double: flashinfer's signature, checked preconditions, the reference's numbers.

    Args:
        q: bf16/fp16 [total_q, Hq, 128], contiguous.
        k: q's dtype [total_k, Hkv, 128], contiguous (flat).
        v: like k.
        q2k_indices: int32 [Hkv, total_q, 16], contiguous: per-sequence block ids, strictly
            ascending, -1 at the tail.
        cu_seqlens_q: int32 [B + 1].
        cu_seqlens_k: int32 [B + 1]; here equal to cu_seqlens_q.
        causal: must be True (the only mode modelled).
        softmax_scale: finite float, or None for head_dim ** -0.5.
        page_table, seqused_k, k_scale, v_scale, k_global_scale, v_global_scale, q_offset,
            workspace: must be None (not modelled).
        return_softmax_lse: also return the LSE.
        return_temperature_lse: must be False.
        lse_temperature_scale: must be 1.0.

    Returns:
        out in q's dtype [total_q, Hq, 128], or ``(out, lse)`` with lse fp32 [total_q, Hq],
        natural log.

    Raises:
        FlashinferContractError: a precondition fails.
        NotImplementedError: an option the double does not model.
    """
    unmodelled = {"page_table": page_table, "seqused_k": seqused_k, "k_scale": k_scale,
                  "v_scale": v_scale, "k_global_scale": k_global_scale,
                  "v_global_scale": v_global_scale, "q_offset": q_offset,
                  "workspace": workspace}
    for name, value in unmodelled.items():
        if value is not None:
            raise NotImplementedError(f"the double does not model {name}")
    if return_temperature_lse or lse_temperature_scale != 1.0:
        raise NotImplementedError("the double does not model the temperature LSE")
    if causal is not True:
        raise NotImplementedError(f"the double models causal=True only, got {causal!r}")

    _require(isinstance(q, torch.Tensor) and q.dtype in (torch.bfloat16, torch.float16),
             f"q must be bf16/fp16, got {getattr(q, 'dtype', type(q))}")
    _require(q.dim() == 3 and q.shape[2] == HEAD_DIM,
             f"q must be (total_q, num_qo_heads, {HEAD_DIM}), got {tuple(q.shape)}")
    _require(q.is_contiguous(), "q must be contiguous")
    total_q, hq, _ = q.shape
    _require(total_q > 0 and hq > 0, "q must hold at least one query and one head")
    for name, x in (("k", k), ("v", v)):
        _require(isinstance(x, torch.Tensor) and x.dim() == 3,
                 f"flat {name} must be (total_k, num_kv_heads, {HEAD_DIM})")
        _require(x.dtype == q.dtype, f"{name} dtype {x.dtype} must match q's {q.dtype}")
        _require(x.is_contiguous(), f"{name} must be contiguous")
        _require(x.device == q.device, f"{name} is on {x.device}, q on {q.device}")
    _require(k.shape == v.shape and k.shape[2] == HEAD_DIM,
             f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (total_k, Hkv, {HEAD_DIM})")
    hkv = k.shape[1]
    _require(hkv > 0 and hq % hkv == 0, f"num_qo_heads={hq} must be a multiple of Hkv={hkv}")
    _require(1 <= hq // hkv <= 16, f"GQA group {hq // hkv} must be in 1..16")
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, q.device)
    _require(cu_seqlens_k is not None, "the flat path needs cu_seqlens_k")
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    _require(len(cu_k) == len(cu_q), f"cu_seqlens_k has {len(cu_k)} entries, cu_seqlens_q "
             f"{len(cu_q)}")
    if cu_k != cu_q:
        raise NotImplementedError("the double models equal query and key lengths only")
    _check_q2k(q2k_indices, cu_q, hkv, total_q, q.device)
    scale = HEAD_DIM**-0.5 if softmax_scale is None else softmax_scale
    _require(isinstance(scale, float) and math.isfinite(scale),
             f"softmax_scale must be a finite float, got {softmax_scale!r}")

    # One document per non-empty sequence, in one row: its block ids are the sequence's.
    lengths = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False) if b > a]
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    msa = MSAMicrobatch.from_document_map(ids[None].to(q.device), block_size=BLOCK)
    out, lse = sparse_attention_forward_reference(q, k, v, q2k_indices, msa, scale)
    lse = lse.t().contiguous()  # [total_q, Hq], natural log, as documented
    return (out, lse) if return_softmax_lse else out
