"""The union lists and the per-tile plan shared by the hybrid forward and dq.

A union tile is ``qt`` consecutive tokens of one document block. For every (KV head, tile)
:func:`tile_unions` builds the sorted union of the blocks its tokens selected, with one Triton
kernel and no host synchronization; :func:`hybrid_plan` turns the union sizes into the split
between the union kernel (tiles whose union is small: K/V read once per tile) and the
per-token kernel (the rest). The forward keeps its lists (:class:`TileUnions`) so that dq,
whose tiles are the same, does not build them again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nemo_msa.triton.kernel_layout import KernelLayout, QuerySubset
from nemo_msa.triton.tiles import advance, next_pow2, subset_rows, union_tile_span

#: The most rows (tokens x padded heads) of one union program: 256-row tiles (16 tokens of 16
#: heads) need more shared memory than an SM has at d = 128 (262 KB > 227 KB, forward and dq).
MAX_UNION_ROWS = 128


@triton.jit
def _previous_of_segment(n1, prev1, last1, n2, prev2, last2):
    """Combine of a scan over segments ``(length, element before the last, last)``: the
    inclusive scan of ``(1, x_i, x_i)`` holds ``x_{i-1}`` in its middle part for ``i >= 1``."""
    return n1 + n2, tl.where(n2 >= 2, prev2, last1), last2


@triton.jit
def _tile_union_kernel(q2k_ptr, union_ptr, count_ptr, cu_ptr, block_doc_ptr, block_local_ptr,
                       stride_sg, stride_st, stride_ug, stride_ut, num_tiles, tiles_ptr, qrow_ptr,
                       TOPK: tl.constexpr, QT: tl.constexpr, BS: tl.constexpr,
                       WIDTH: tl.constexpr, W: tl.constexpr, TP: tl.constexpr,
                       SUBSET: tl.constexpr):
    """``TP`` union tiles of one KV head: the sorted distinct blocks their tokens selected, in
    registers (no sort temporaries in memory), one [TP, W] row per tile.

    The entries are sorted; an entry is kept where it differs from its predecessor
    (:func:`_previous_of_segment`), and an inclusive count of the kept ones gives each its place
    in the list, so no second sort is needed.

    With SUBSET the tiles are the entries of the list ``tiles`` (global tile ids) and only
    their local queries' selections count (read at their local rows, ``query_row``)."""
    BIG: tl.constexpr = 2147483647
    tiles = tl.program_id(0) * TP + tl.arange(0, TP)
    g = tl.program_id(1)
    live = tiles < num_tiles
    gtile = tl.minimum(tiles, num_tiles - 1)
    if SUBSET:
        gtile = tl.load(tiles_ptr + gtile)
    doc, start, length, p0 = union_tile_span(gtile, block_doc_ptr, block_local_ptr, cu_ptr, QT,
                                             BS)
    i = tl.arange(0, W)
    pos = p0[:, None] + (i // TOPK)[None, :]
    valid = ((live & (doc >= 0))[:, None] & (i < WIDTH)[None, :]) & (pos < length[:, None])
    rows, valid = subset_rows(start[:, None] + pos, valid, qrow_ptr, SUBSET)
    ids = tl.load(advance(q2k_ptr, g, stride_sg) + rows * stride_st + (i % TOPK)[None, :],
                  mask=valid, other=-1)
    key = tl.where(ids >= 0, ids, BIG)
    dst = advance(advance(union_ptr, g, stride_ug), tiles[:, None], stride_ut)
    key = tl.sort(key)
    n, prev, _ = tl.associative_scan((tl.full((TP, W), 1, tl.int32), key, key), 1,
                                     _previous_of_segment)
    kept = (key != BIG) & ((n < 2) | (prev != key))
    place = tl.cumsum(kept.to(tl.int32), axis=1) - 1
    count = tl.sum(kept.to(tl.int32), axis=1)
    # The kept entries go to places 0..count-1, zeros to count..WIDTH-1: disjoint stores.
    tl.store(dst + place, key, mask=live[:, None] & kept)
    tl.store(dst + i[None, :], tl.zeros((TP, W), tl.int32),
             mask=(live[:, None] & (i < WIDTH)[None, :]) & (i[None, :] >= count[:, None]))
    tl.store(advance(count_ptr, g, num_tiles) + tiles, count, mask=live)


def tile_unions(q2k: torch.Tensor, view: KernelLayout, qt: int, *, tiles_per_program: int = 1,
                warps: int = 1,
                subset: QuerySubset | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (KV head, query tile of ``qt`` tokens of one document block): the sorted union of the
    tokens' selected blocks.

    Args:
        q2k: int32 [Hkv, T, top_k] document-local block ids, -1 for none.
        view: the layout's kernel view.
        qt: tokens per tile; divides ``view.block_size``.
        tiles_per_program: union tiles per program of the build kernel (a power of two).
        warps: warps per program of the build kernel.
        subset: a query subset (q2k then has its Tq rows): the tiles are its tile list's, and
            only its local queries' selections count.

    Returns:
        ``(union int32 [Hkv, tiles, qt * top_k] (entries past ``count`` are 0), count int32
        [Hkv, tiles])`` with ``tiles = num_blocks_bound * block_size // qt`` (with a subset,
        the length of its list of ``qt``-token tiles); device ops only.
    """
    q2k = q2k.contiguous()
    hkv, _, top_k = q2k.shape
    bs = view.block_size
    tiles = view.num_blocks_bound * (bs // qt) if subset is None else subset.tile_list(qt).numel()
    width = qt * top_k
    union = torch.empty((hkv, tiles, width), dtype=torch.int32, device=q2k.device)
    count = torch.empty((hkv, tiles), dtype=torch.int32, device=q2k.device)
    _tile_union_kernel[(triton.cdiv(tiles, tiles_per_program), hkv)](
        q2k_ptr=q2k, union_ptr=union, count_ptr=count, cu_ptr=view.cu_seqlens,
        block_doc_ptr=view.block_doc, block_local_ptr=view.block_local,
        stride_sg=q2k.stride(0), stride_st=q2k.stride(1), stride_ug=union.stride(0),
        stride_ut=union.stride(1), num_tiles=tiles,
        tiles_ptr=view.cu_seqlens if subset is None else subset.tile_list(qt),
        qrow_ptr=view.cu_seqlens if subset is None else subset.query_row,
        TOPK=top_k, QT=qt, BS=bs, WIDTH=width, W=next_pow2(width), TP=tiles_per_program,
        SUBSET=subset is not None, num_warps=warps)
    return union, count


@dataclass(frozen=True)
class HybridPlan:
    """The per-tile split of a hybrid launch (forward or dq) between union and per-token kernels.

    Attributes:
        qt: tokens per union tile; 0 when the union kernel is off.
        union: int32 [Hkv, tiles, qt * top_k] union lists (None when off).
        count: int32 [Hkv, tiles] union sizes; tiles with ``count <= max_count`` run the union
            kernel, the others the per-token kernel (a never-read placeholder when off).
        num_tiles: tiles per KV head (0 when off).
        max_count: the largest union the union kernel takes.
    """

    qt: int
    union: torch.Tensor | None
    count: torch.Tensor
    num_tiles: int
    max_count: int

    @property
    def enabled(self) -> bool:
        return self.qt > 0


@dataclass(frozen=True)
class TileUnions:
    """The union lists of one selection, kept by the forward for dq (same tiles, same lists),
    so that the backward skips its own build.

    Attributes:
        qt: tokens per union tile.
        union: int32 [Hkv, tiles, qt * top_k] sorted distinct blocks per tile (0 past count).
        count: int32 [Hkv, tiles] union sizes.
        source: ``(data_ptr, version, shape)`` of the q2k they were built from; the backward
            refuses them for another q2k, or one changed in place since.
        nonfinite: int32 [Hkv, T] running count of the K/V rows holding a NaN/Inf
            (:func:`~nemo_msa.triton.guards.nonfinite_row_counts`), or None; dq's union
            launches take it where ``kv_source`` is the identity of the k and v they get.
        kv_source: ``(tensor_identity(k), tensor_identity(v))`` of the forward's k and v, or None.
    """

    qt: int
    union: torch.Tensor
    count: torch.Tensor
    source: tuple
    nonfinite: torch.Tensor | None = None
    kv_source: tuple | None = None


def tensor_identity(x: torch.Tensor) -> tuple:
    """What ties :class:`TileUnions` to its q2k (and its NaN/Inf counts to k and v): storage
    address, in-place version, shape."""
    return x.data_ptr(), x._version, tuple(x.shape)


def union_tile_tokens(union_qt: int, block_size: int, gp: int) -> int:
    """Tokens per union tile for a requested ``union_qt`` (> 0): at most a block, and at most
    ``MAX_UNION_ROWS`` rows of ``gp`` padded heads."""
    return max(1, min(int(union_qt), block_size, MAX_UNION_ROWS // gp))


def hybrid_plan(q2k: torch.Tensor, view: KernelLayout, union_qt: int, union_max: int, gp: int,
                placeholder: torch.Tensor, *, build_tiles: int = 1, build_warps: int = 1,
                unions: TileUnions | None = None,
                subset: QuerySubset | None = None) -> HybridPlan:
    """Builds the split for ``union_qt``-token tiles (capped so a tile has at most
    ``MAX_UNION_ROWS`` rows of ``gp`` padded heads), or a disabled plan whose tensors are
    ``placeholder`` when it is 0. ``unions`` built for the same tile size (the forward's, checked
    against q2k by the caller) are used instead of building the lists again; otherwise they are
    built with ``build_tiles`` tiles per program of ``build_warps`` warps. With a query
    ``subset`` the tiles are its list's (``num_tiles`` its length)."""
    if union_qt <= 0:
        return HybridPlan(0, None, placeholder, 0, 0)
    bs = view.block_size
    qt = union_tile_tokens(union_qt, bs, gp)
    if unions is not None and unions.qt == qt:
        union, count = unions.union, unions.count
    else:
        union, count = tile_unions(q2k, view, qt, tiles_per_program=build_tiles,
                                   warps=build_warps, subset=subset)
    return HybridPlan(qt, union, count, union.shape[1], int(union_max))
