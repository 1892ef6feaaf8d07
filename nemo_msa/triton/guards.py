"""@triton.jit guards that keep a non-finite key or value inside the rows that attend it.

A tile's matrix products mix every row with every key of the tile: P V, dS K and dO V^T
multiply a masked probability (or dS) of 0 with a key the row does not see, and 0 * NaN =
0 * Inf = NaN. The attention kernels use these helpers on the tiles that hold pairs a row does
not see (the union kernels' own block, and whole blocks that only some rows selected), so a NaN
or Inf in K or V reaches exactly the rows of the float64 rule (nemo_msa.testing.nonfinite,
ADR 0025). Tiles every row sees whole, and the per-token kernels (whose loads already zero the
keys the token does not see), pay nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
