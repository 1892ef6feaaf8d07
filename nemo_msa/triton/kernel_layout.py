"""Device-side index tensors shared by the Triton MSA kernels (no host synchronization).

The kernels address key block ``b`` of a document straight in the compact token order
(ADR 0001): rows ``[cu_seqlens[doc] + bs * b, min(cu_seqlens[doc + 1], ...))``. Two small maps
are built here with plain torch ops on the layout's device tensors:

* the kernels' typed view of the layout (:class:`KernelLayout`), with the *doc-block* map:
  global block id -> (document, document-local block). Every document of length ``n`` owns
  ``ceil(n / bs)`` consecutive global ids. The number of global ids is only known on the
  device; the grids use the host bound ``num_tokens // bs + num_documents`` and the surplus
  programs exit at once. This is what lets the selection kernel and the KV-outer backward run
  one program per (document, block) without a ``.item()``.
* the block -> queries CSR of the backward (see :func:`block_query_csr`).

Nothing here reads a tensor's value on the host.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from nemo_msa.backends.capabilities import TRITON
from nemo_msa.tensor_memo import TensorMemo

# The Triton interpreter computes tl.dot on bf16 operands wrongly (PLATFORM.md); kernels take
# this as a constexpr and cast their dot operands to fp32 when it is set.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_run_on(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run on ``x``'s device: CUDA, or the host under the
    interpreter. The helpers ask it for a direct caller (no plan: the layer's plan names its
    helpers' kernels, :class:`nemo_msa.plan.MSAKernels`), and to refuse a device the plan's
    kernel cannot run on."""
    return x.is_cuda or INTERPRET


def _host_int(msa, name: str) -> int:
    value = getattr(msa, name, None)
    if not isinstance(value, int):
        raise ValueError(f"msa.{name} must be a host int, got {type(value).__name__}")
    return value


def check_kernel_devices(view, **tensors: torch.Tensor) -> None:
    """Checks that the kernel inputs and the layout view (a :class:`KernelLayout`) share a
    device the kernels can run on.

    Compiled kernels need CUDA tensors; the interpreter (``TRITON_INTERPRET=1``) needs host ones.
    Without this check a wrong device surfaces as Triton's bare "Pointer argument (at 0)" error.

    Raises:
        ValueError: naming the first tensor on the wrong device.
    """
    expected = "cpu" if INTERPRET else "cuda"
    tensors = {**tensors, "msa.cu_seqlens": view.cu_seqlens}
    first = None
    for name, x in tensors.items():
        if x.device.type != expected:
            how = ("TRITON_INTERPRET=1 is set, so the interpreter runs the kernels on the host"
                   if INTERPRET else "compiled Triton kernels need CUDA tensors (set "
                   "TRITON_INTERPRET=1 before importing nemo_msa to interpret them on the CPU)")
            raise ValueError(f"{name} is on {x.device}: expected a {expected} tensor ({how})")
        if first is None:
            first = (name, x.device)
        elif x.device != first[1]:
            raise ValueError(f"{name} is on {x.device} but {first[0]} is on {first[1]}: expected "
                             "every input and the layout on one device")


@dataclass(frozen=True)
class KernelLayout:
    """What the Triton kernels read of one layout, for one block size: typed, device tensors.

    Built once per layout and block size by :func:`kernel_layout` (an ``MSAMicrobatch`` keeps
    it, so every layer of the microbatch reuses it). The doc-block map gives each document of
    length ``n`` ``ceil(n / bs)`` consecutive global block ids; how many exist is known only on
    the device, so grids use the host bound ``num_blocks_bound`` and surplus programs exit.

    Attributes:
        block_size: tokens per key block (host int).
        num_tokens: T (host int).
        num_documents: D (host int).
        num_blocks_bound: host upper bound on the number of global blocks
            (``num_tokens // block_size + num_documents``); grids are sized with it.
        cu_seqlens: int32 [D + 1]; compact start of each document, then T.
        block_doc: int32 [num_blocks_bound]; the document of each global block, -1 past the end.
        block_local: int32 [num_blocks_bound]; the document-local block id (0 past the end).
        doc_first_block: int64 [D]; global id of block 0 of each document.
        token_first_block: int64 [T]; global id of block 0 of each token's document.
        token_start: int32 [T]; compact row of the first token of each token's document.
        token_pos: int32 [T]; document-local position of each token.
    """

    block_size: int
    num_tokens: int
    num_documents: int
    num_blocks_bound: int
    cu_seqlens: torch.Tensor
    block_doc: torch.Tensor
    block_local: torch.Tensor
    doc_first_block: torch.Tensor
    token_first_block: torch.Tensor
    token_start: torch.Tensor
    token_pos: torch.Tensor


def kernel_layout(msa, block_size: int) -> KernelLayout:
    """The kernels' view of ``msa`` for ``block_size``.

    Args:
        msa: an ``MSAMicrobatch`` (its :meth:`~nemo_msa.layout.MSAMicrobatch.kernel_layout`
            builds the view once and keeps it) or a :class:`KernelLayout` of that block size.
        block_size: key block size in tokens.

    Raises:
        ValueError: for a :class:`KernelLayout` of another block size.
        TypeError: for anything else.
    """
    if isinstance(msa, KernelLayout):
        if msa.block_size != block_size:
            raise ValueError(f"a KernelLayout of block_size={msa.block_size} was given for "
                             f"block_size={block_size}")
        return msa
    # Duck-typed: the layout module imports this one, so it cannot name MSAMicrobatch here.
    if not callable(getattr(type(msa), "kernel_layout", None)):
        raise TypeError(f"msa must be an MSAMicrobatch or a KernelLayout; got "
                        f"{type(msa).__name__}")
    return msa.kernel_layout(block_size)


def build_kernel_layout(msa, block_size: int) -> KernelLayout:
    """Builds the :class:`KernelLayout` of ``msa`` for ``block_size`` from its host document
    lengths, with one host-to-device copy and no device op.

    The maps are functions of the document lengths alone (documents are contiguous and in
    order in the compact order), which the layout read on the host in its one synchronization.
    Computing them there and uploading one buffer replaces about twenty small device ops, each
    a launch the host pays on the forward's critical path (issue #50).

    Args:
        msa: layout with host ints ``num_tokens``, ``num_documents``, its host document lengths
            (``checked_document_lengths()``, compact order) and device tensors ``cu_seqlens``
            int32 [D + 1] and ``document_positions`` int32 [T].
        block_size: key block size in tokens.

    Returns:
        The view; every tensor lives on ``cu_seqlens``' device.

    Raises:
        ValueError: host lengths that disagree with ``num_tokens`` / ``num_documents``
            (``checked_document_lengths``).
    """
    num_tokens = _host_int(msa, "num_tokens")
    num_docs = _host_int(msa, "num_documents")
    lengths = np.asarray(msa.checked_document_lengths(), dtype=np.int64)
    bound = num_tokens // block_size + num_docs
    nblk = (lengths + block_size - 1) // block_size
    first = np.cumsum(nblk) - nblk
    used = int(nblk.sum())
    block_doc = np.full(bound, -1, dtype=np.int32)
    block_doc[:used] = np.repeat(np.arange(num_docs, dtype=np.int32), nblk)
    block_local = np.zeros(bound, dtype=np.int32)
    block_local[:used] = np.arange(used, dtype=np.int32) - np.repeat(first.astype(np.int32), nblk)
    starts = (np.cumsum(lengths) - lengths).astype(np.int32)
    (doc_first_block, token_first_block, block_doc, block_local, token_start) = _upload(
        (first, np.repeat(first, lengths), block_doc, block_local, np.repeat(starts, lengths)),
        msa.cu_seqlens.device,
    )
    return KernelLayout(
        block_size=block_size,
        num_tokens=num_tokens,
        num_documents=num_docs,
        num_blocks_bound=bound,
        cu_seqlens=msa.cu_seqlens,
        block_doc=block_doc,
        block_local=block_local,
        doc_first_block=doc_first_block,
        token_first_block=token_first_block,
        token_start=token_start,
        token_pos=msa.document_positions.to(torch.int32).contiguous(),
    )


def _upload(arrays, device: torch.device) -> list[torch.Tensor]:
    """The int32/int64 host arrays as tensors on ``device``, through one staging buffer and one
    copy (the tensors are views of the copy, each 128-byte aligned as the kernels' pointer
    arguments are specialized on 16-byte alignment).

    On CUDA the staging buffer is pinned and the copy asynchronous: no synchronization, and
    the caching host allocator keeps the buffer until the copy has run."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 128) * 128
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw = staging.numpy()
    for a, at in zip(arrays, offsets, strict=True):
        raw[at:at + a.nbytes] = a.view(np.uint8)
    buffer = staging if device.type == "cpu" else staging.to(device, non_blocking=True)
    dtypes = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}
    return [buffer[at:at + a.nbytes].view(dtypes[a.dtype])
            for a, at in zip(arrays, offsets, strict=True)]


def check_attention_inputs(q, k, v, q2k, view: KernelLayout, subset: QuerySubset | None = None):
    """Validates the shared inputs of the forward and backward; returns (Tq, Hq, Hkv, d, G, K).

    Without ``subset`` every token is a query (Tq = T); with it q and q2k hold the
    ``subset.num_queries`` local queries and k / v the layout's T keys.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be bf16 or fp16, got {x.dtype}")
        if x.dim() != 3:
            raise ValueError(f"{name} must be [T, heads, d], got shape {tuple(x.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    t, hq, d = q.shape
    tk = view.num_tokens if subset is not None else t
    if k.shape != v.shape or k.shape[0] != tk or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T={tk}, Hkv, "
                         f"d={d}] like q {tuple(q.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads Hq={hq} must be a multiple of KV heads Hkv={hkv}")
    if q2k.dtype != torch.int32 or q2k.dim() != 3 or q2k.shape[:2] != (hkv, t):
        raise ValueError(f"q2k must be int32 [Hkv={hkv}, T={t}, top_k], got {q2k.dtype} "
                         f"{tuple(q2k.shape)}")
    reason = TRITON.why_not(head_dim=d, top_k=q2k.shape[2])
    if reason is not None:
        raise ValueError(f"q {tuple(q.shape)}, q2k {tuple(q2k.shape)}: {reason}")
    if subset is not None and t != subset.num_queries:
        raise ValueError(f"q has {t} rows but queries holds {subset.num_queries} tokens")
    if subset is None and t != view.num_tokens:
        raise ValueError(f"q has T={t} tokens but msa.num_tokens={view.num_tokens}")
    check_kernel_devices(view, q=q, k=k, v=v, q2k=q2k)
    return t, hq, hkv, d, hq // hkv, q2k.shape[2]


def check_block_size(block_size: int) -> None:
    """The kernels take the block sizes of :data:`nemo_msa.backends.capabilities.TRITON`."""
    reason = TRITON.why_not(block_size=block_size)
    if reason is not None:
        raise ValueError(reason)


@dataclass(frozen=True)
class BlockQueryCSR:
    """For every (KV head, global block), the query tokens that selected it.

    Attributes:
        offsets: int64 [Hkv * num_blocks_bound + 1]; entries of segment ``g * bound + blk`` are
            ``tokens[offsets[i]:offsets[i + 1]]``, ascending token ids.
        tokens: int32 [Hkv * T * top_k]; selected (token) entries, invalid slots at the tail.
        order: int32 [Hkv * num_blocks_bound]; segments by descending size, so that the long
            lists (early blocks of long documents) start first.
    """

    offsets: torch.Tensor
    tokens: torch.Tensor
    order: torch.Tensor


#: Per rows object (a layout's kernel view or a query subset, both built once per microbatch):
#: the terms of :func:`block_query_csr` that depend on the layout only, shared by every layer.
_CSR_TERMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _csr_terms(rows, hkv: int, bound: int, bs: int, idx: torch.dtype):
    """``(own [1, T, 1], base [Hkv, T, 1], seg [Hkv * bound + 1])`` in ``idx``: each query's
    own block, its (head, document block 0) sort key base, and the segment ids."""
    per_rows = _CSR_TERMS.setdefault(rows, {})
    key = (hkv, bound, bs, idx)
    found = per_rows.get(key)
    if found is None:
        t = rows.token_pos.shape[0]
        device = rows.token_pos.device
        own = (rows.token_pos // bs).to(idx).view(1, t, 1)
        head = torch.arange(hkv, device=device, dtype=idx).view(hkv, 1, 1)
        base = head * bound + rows.token_first_block.to(idx).view(1, t, 1)
        seg = torch.arange(hkv * bound + 1, device=device, dtype=idx)
        found = per_rows[key] = (own, base, seg)
    return found


def block_query_csr(q2k: torch.Tensor, blocks: KernelLayout,
                    subset: QuerySubset | None = None) -> BlockQueryCSR:
    """Inverts ``q2k`` into the block -> queries CSR used by the KV-outer dk/dv kernel.

    A stable sort on (head, global block) keeps each list in ascending token order, so the
    reduction order inside a list (and so dk/dv) is deterministic. Slots that are -1 or name a
    block past the query's own block (out of contract) are dropped: they cannot hold a visible
    key, and a block past the document end would otherwise alias the next document.

    Args:
        q2k: int32 [Hkv, T, top_k] document-local block ids, -1 for none ([Hkv, Tq, top_k]
            with ``subset``: the lists then hold local query rows).
        blocks: the kernel view of the same layout.
        subset: the query subset (:func:`query_subset`), or None for every token.

    Returns:
        The :class:`BlockQueryCSR`.
    """
    hkv, t, top_k = q2k.shape
    bound = blocks.num_blocks_bound
    bs = blocks.block_size
    # 32-bit keys and entry ids whenever they fit (always, short of 2^31 entries): the sort's
    # temporaries are most of the backward's extra memory.
    wide = hkv * bound + 1 >= 2**31 or hkv * t * top_k >= 2**31
    idx = torch.int64 if wide else torch.int32
    b = q2k.to(idx)
    rows = blocks if subset is None else subset
    own, base, seg = _csr_terms(rows, hkv, bound, bs, idx)
    key = torch.where((b >= 0) & (b <= own), base + b, hkv * bound)
    sorted_keys, order = torch.sort(key.reshape(-1), stable=True)
    del key, b
    tokens = (order // top_k % max(t, 1)).to(torch.int32)
    del order
    offsets = torch.searchsorted(sorted_keys, seg)
    sizes = offsets[1:] - offsets[:-1]
    seg_order = torch.sort(sizes, descending=True, stable=True).indices.to(torch.int32)
    return BlockQueryCSR(offsets=offsets.contiguous(), tokens=tokens.contiguous(),
                         order=seg_order.contiguous())


@dataclass(frozen=True, eq=False)
class QuerySubset:
    """The query side of a query-subset launch (context parallelism): ``Tq`` local queries at
    known global compact rows, against the layout's T keys (ADR 0021).

    Attributes:
        num_queries: Tq (host int).
        queries: int64 [Tq]; global compact row of each local query, ascending and unique.
        query_row: int32 [T]; local row of each global token, -1 for a token not in the subset.
        token_start: int32 [Tq]; compact row of the first token of each query's document.
        token_pos: int32 [Tq]; document-local position of each query.
        token_first_block: int64 [Tq]; global id of block 0 of each query's document.
        tiles: per tile size ``qt`` (a power of two up to the block size), int32 [n]: the
            ascending global ids of the ``qt``-token tiles (``block * (bs // qt) + sub``, the
            tiles of the full launch) that hold at least one local query. Load-balanced
            chunks are contiguous runs of the compact order, so these are the full launch's
            tiles that meet a run.
    """

    num_queries: int
    queries: torch.Tensor
    query_row: torch.Tensor
    token_start: torch.Tensor
    token_pos: torch.Tensor
    token_first_block: torch.Tensor
    tiles: dict

    def tile_list(self, qt: int) -> torch.Tensor:
        """int32 [n]: the global ids of the ``qt``-token tiles holding a local query."""
        try:
            return self.tiles[int(qt)]
        except KeyError:
            raise ValueError(f"tile size qt={qt}: expected one of {sorted(self.tiles)}") \
                from None


def build_query_subset(view: KernelLayout, queries: torch.Tensor) -> QuerySubset:
    """Builds the :class:`QuerySubset` of ``queries`` for the kernel view ``view``.

    One device-to-host synchronization reads the tile counts of every tile size and the
    validity of ``queries`` together (memoized per layout and queries tensor by
    :func:`query_subset`, so once per microbatch).

    Args:
        view: the layout's kernel view.
        queries: int64 [Tq] global compact rows of the local queries, ascending and unique.

    Raises:
        ValueError: naming ``queries``: not int64 1-D on the layout's device, out of
            ``[0, T)``, not strictly ascending.
    """
    t = view.num_tokens
    if not isinstance(queries, torch.Tensor) or queries.dtype != torch.int64 \
            or queries.dim() != 1:
        got = (f"{queries.dtype} {tuple(queries.shape)}" if isinstance(queries, torch.Tensor)
               else type(queries).__name__)
        raise ValueError(f"queries must be an int64 [Tq] tensor of global compact rows, got {got}")
    if queries.device != view.cu_seqlens.device:
        raise ValueError(f"queries is on {queries.device} but the layout on "
                         f"{view.cu_seqlens.device}")
    tq = queries.numel()
    bs = view.block_size
    sizes = [1 << i for i in range(bs.bit_length()) if (1 << i) <= bs]
    q = queries.clamp(0, max(t - 1, 0))
    pos32 = view.token_pos[q] if t else q.to(torch.int32)
    first = view.token_first_block[q] if t else q
    # A query's tile of size qt in the full launch is block * (bs // qt) + (pos % bs) // qt,
    # i.e. (block * bs + pos % bs) // qt = (first * bs + pos) >> log2(qt): every size's ids in
    # one [sizes, Tq] tensor, so the subset costs a handful of kernels whatever the block size
    # (one set per size was ~11 kernels each, 88 per subset at blocks of 128: issue #28).
    start = first * bs + pos32
    shift = torch.arange(len(sizes), dtype=torch.int64, device=queries.device)
    tile_ids = start.unsqueeze(0) >> shift.unsqueeze(1)  # [S, Tq] int64
    change = tile_ids[:, 1:] != tile_ids[:, :-1]  # [S, Tq - 1]
    if tq:
        steps = change.sum(1) + 1
        bad = torch.stack([(queries < 0).any() | (queries >= t).any(),
                           (queries[1:] <= queries[:-1]).any()]).to(torch.int64)
        host = torch.cat([steps, bad]).tolist()
    else:
        host = [0] * len(sizes) + [0, 0]
    if host[-2]:
        raise ValueError(f"queries holds rows outside [0, T={t}): expected global compact rows "
                         f"of the layout")
    if host[-1]:
        raise ValueError("queries must be strictly ascending (unique global compact rows in the "
                         "layout's order)")
    counts = host[:len(sizes)]
    # Tile ids are non-decreasing along the queries: a tile's slot is the count of changes
    # before it; every query of a tile writes the same id to the same slot. Row s of ``lists``
    # holds size s's list in its first counts[s] entries.
    lists = torch.zeros(len(sizes), max(counts, default=0), dtype=torch.int32,
                        device=queries.device)
    if tq:
        slot = torch.nn.functional.pad(torch.cumsum(change, 1), (1, 0))
        lists.scatter_(1, slot, tile_ids.to(torch.int32))
    tiles = {qt: lists[i, :n] for i, (qt, n) in enumerate(zip(sizes, counts, strict=True))}
    row = torch.full((t,), -1, dtype=torch.int32, device=queries.device)
    row[queries] = torch.arange(tq, dtype=torch.int32, device=queries.device)
    return QuerySubset(
        num_queries=tq, queries=queries, query_row=row,
        token_start=view.token_start[q].contiguous() if t else q.to(torch.int32),
        token_pos=pos32.contiguous(),
        token_first_block=first.contiguous(),
        tiles=tiles)


def query_subset(msa, block_size: int, queries: torch.Tensor | None) -> QuerySubset | None:
    """The :class:`QuerySubset` of ``queries`` (None for None: every token is a query).

    With an ``MSAMicrobatch`` it is built once per (block size, queries tensor) and kept on
    the layout while the tensor lives and is not written in place; other layouts build it on
    each call.
    """
    if queries is None:
        return None
    view = kernel_layout(msa, block_size)
    cached = getattr(msa, "cached", None)
    if not callable(cached) or isinstance(msa, KernelLayout):
        return build_query_subset(view, queries)
    memo = cached(f"triton_query_subsets_{block_size}", TensorMemo)
    subset = memo.get(queries)
    if subset is None:
        subset = build_query_subset(view, queries)
        memo.put(queries, None, subset)
    return subset


def subset_pointers(subset, qt: int, view) -> dict:
    """The ``tiles_ptr`` / ``qrow_ptr`` kernel arguments of a query subset: its list of
    ``qt``-token tiles (``qt`` 0: no union tiles) and its ``query_row`` map; never-read
    placeholders without a subset."""
    if subset is None:
        return {"tiles_ptr": view.cu_seqlens, "qrow_ptr": view.cu_seqlens}
    tiles = subset.tile_list(qt) if qt > 0 else subset.query_row
    return {"tiles_ptr": tiles, "qrow_ptr": subset.query_row}
