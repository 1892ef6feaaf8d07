"""@triton.jit guards that keep a non-finite key or value inside the rows that attend it.

A tile's matrix products mix every row with every key of the tile: P V, dS K and dO V^T
multiply a masked probability (or dS) of 0 with a key the row does not see, and 0 * NaN =
0 * Inf = NaN. The attention kernels use these helpers on the tiles that hold pairs a row does
not see (the union kernels' own block, and whole blocks that only some rows selected), so a NaN
or Inf in K or V reaches exactly the rows of the float64 rule (nemo_msa.testing.nonfinite,
ADR 0025). Tiles every row sees whole, and the per-token kernels (whose loads already zero the
keys the token does not see), pay nothing.

The union kernels' whole blocks need the guard only where a block holds a non-finite K or V
row: elsewhere a row that did not select the block has probability exactly 0 there and keeps
its sums unchanged. :func:`nonfinite_row_counts` counts those rows once per launch, and
:func:`union_rows_finite` tells a union program whether the rows of its blocks are all finite,
so that it runs them unguarded (ADR 0032): the guard keeps the old accumulator live beside the
new one, which costs the hot loop its registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nemo_msa.triton.tiles import advance


@triton.jit
def finite_rows(x):
    """bool [N]: the rows of an [N, D] tile that hold only finite values."""
    ok = (x == x) & (tl.abs(x) != float("inf"))
    return tl.min(ok.to(tl.int32), axis=1) > 0


@triton.jit
def finite_values(v, vis, poisoned):
    """V of a masked tile with its non-finite rows zeroed, and the rows that see one.

    Args:
        v: [N, D] values; vis: bool [M, N] visible pairs; poisoned: bool [M] so far.

    Returns:
        ``(v, poisoned)``: v with 0 in every row holding a NaN/Inf (a zero probability then
        meets 0), and ``poisoned`` or-ed with the rows that see such a value (their output is
        set to NaN at the end, :func:`poison_rows`).
    """
    ok = finite_rows(v)
    seen = tl.max((vis & (~ok)[None, :]).to(tl.int32), axis=1) > 0
    return tl.where(ok[:, None], v, 0.0), poisoned | seen


@triton.jit
def poison_rows(out, poisoned):
    """``out`` [M, D] with NaN in the rows ``poisoned`` (bool [M])."""
    return tl.where(poisoned[:, None], float("nan"), out)


@triton.jit
def dq_tile_masked(q, do, k, v, vis, lse2, delta, scale_log2):
    """:func:`nemo_msa.triton.tiles.dq_tile` for a tile with pairs a row does not see: dS is 0
    there even where dO V^T is not finite, and K's non-finite rows enter dS K as 0 (a row
    that sees one has a non-finite dS there already, so its dq stays non-finite)."""
    sc = tl.dot(q, tl.trans(k)) * scale_log2
    pr = tl.where(vis, tl.exp2(sc - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = tl.where(vis, pr * (dp - delta[:, None]), 0.0)
    k = tl.where(finite_rows(k)[:, None], k, 0.0)
    return tl.dot(ds.to(k.dtype), k)


@triton.jit
def finite_delta(lse2, delta):
    """``(lse2, delta)`` of a KV-outer backward step's rows with delta = rowsum(dO O) finite.

    A row that attends a NaN/Inf has a non-finite delta, and dS = P (dP - delta) would put
    0 * NaN into the dk of keys it does not see. Its delta becomes 0 and its LSE NaN instead:
    its probabilities, and so its dS and P^T dO, are NaN on the pairs it sees and 0 elsewhere.
    Costs two selects per row, none per pair."""
    ok = (delta == delta) & (tl.abs(delta) != float("inf"))
    return tl.where(ok, lse2, float("nan")), tl.where(ok, delta, 0.0)


@triton.jit
def _nonfinite_rows_kernel(k_ptr, v_ptr, flag_ptr, T, stride_kt, stride_kh, stride_vt,
                           stride_vh, stride_fg, D: tl.constexpr, DP: tl.constexpr,
                           BT: tl.constexpr):
    """flag[g, t] = 1 where K[t, g, :] or V[t, g, :] holds a NaN/Inf, else 0 (int32)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    g = tl.program_id(1)
    dd = tl.arange(0, DP)
    inside = t < T
    mask = inside[:, None] & (dd < D)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64[:, None] * stride_kt + g * stride_kh + dd[None, :], mask=mask,
                other=0.0)
    v = tl.load(v_ptr + t64[:, None] * stride_vt + g * stride_vh + dd[None, :], mask=mask,
                other=0.0)
    # In fp32: the interpreter compares bf16 by its bits, where NaN == NaN.
    bad = (finite_rows(k.to(tl.float32)) & finite_rows(v.to(tl.float32))) == 0
    tl.store(advance(flag_ptr, g, stride_fg) + t64, bad.to(tl.int32), mask=inside)


def nonfinite_row_counts(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Running count of the (token, KV head) rows of K or V that hold a NaN/Inf.

    Args:
        k: [T, Hkv, d] keys (last dim contiguous).
        v: [T, Hkv, d] values, k's shape (last dim contiguous).

    Returns:
        int32 [Hkv, T]: for KV head g and token t, how many of the rows ``0..t`` of head g hold
        a non-finite value in K or V (inclusive), so rows ``a..b`` are all finite iff
        ``counts[g, b] - counts[g, a - 1]`` (0 for a = 0) is 0. Two launches, no host sync.
    """
    t, hkv, d = k.shape
    flags = torch.empty((hkv, t), dtype=torch.int32, device=k.device)
    if t > 0:
        bt = 32
        _nonfinite_rows_kernel[(triton.cdiv(t, bt), hkv)](
            k, v, flags, t, k.stride(0), k.stride(1), v.stride(0), v.stride(1), flags.stride(0),
            D=d, DP=triton.next_power_of_2(d), BT=bt, num_warps=4)
    return torch.cumsum(flags, dim=1, dtype=torch.int32)


@triton.jit
def union_rows_finite(counts_ptr, g, stride_cg, union_row_ptr, n, start, length,
                      BS: tl.constexpr, UW: tl.constexpr):
    """Whether the document rows of the first ``n`` entries of a union row (sorted block ids
    of the document whose first compact row is ``start`` and whose length is ``length``) hold
    only finite K and V values of KV head ``g``; ``counts`` is :func:`nonfinite_row_counts`'s
    [Hkv, T] (head stride ``stride_cg``). One gather of 2 x UW counts per program."""
    uu = tl.arange(0, UW)
    inside = uu < n
    b = tl.load(union_row_ptr + uu, mask=inside, other=0)
    first = start + b * BS
    last = start + tl.minimum(b * BS + BS, length) - 1
    row = advance(counts_ptr, g, stride_cg)
    at_last = tl.load(row + last, mask=inside, other=0)
    before = tl.load(row + first - 1, mask=inside & (first > 0), other=0)
    return tl.sum(at_last - before) == 0
