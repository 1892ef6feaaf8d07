"""The block-sparse attention peers of ``bench_sparse_peers.py`` on one MSA selection (ADR 0056).

Each side is a :class:`Side`: how it splits the heads into calls, whether it takes a batch
dimension, and its call. The harness prepares every side's leaves (fresh clones with gradients)
and output gradients the same way, so all sides run forward and backward under one timing loop.

- ``ours``: ``nemo_msa.sparse_attention`` (Triton on the GPU), the reference of the checks.
- ``fa4``: FlashAttention-4 4.0.0b40's ``flash_attn_func`` with per-tile block lists and a
  ``mask_mod`` reading each token's selected blocks (:func:`fa4_mask_mod`): MSA's function.
- ``fa4_union``: the same lists without ``mask_mod`` (``causal=True``): attention over the whole
  union of each 128-token tile, another function (a rate bound only, not checked against ours).
- ``cudnn_flex``: cuDNN-FE 1.32's ``cudnn.flex_attention.flex_attn_func`` with an interval mask
  per KV head (one call per KV head: a plan's bitmask payload is per mask head and tile pair, so
  a 64-head mask would be 16 times larger): MSA's function.
- ``cudnn_bsa``: cuDNN-FE 1.32's block-sparse attention (``cudnn.block_sparse_attention``, SM90
  128-token blocks) on the same unions. It takes per query tile a list of key blocks and nothing
  finer: no causal mask and no per-token mask (``_interface.bsa_attn_fwd``: "non-causal,
  non-varlen"), and its backward takes no GQA (``bsa_attn_bwd``: "bwd does not support
  GQA/MQA"), so K/V are repeated over the query heads for it and dK/dV summed back, inside its
  timing. Each tile attends every key of its union, the own block's later keys included:
  another function, a rate bound only.
- ``cudnn_dense``: cuDNN SDPA, causal, GQA, over the document: the pair rate's baseline.

The formats are built by :mod:`msa_bench.sparse_formats` (CPU-tested); this module needs the
peers' packages only when a side is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from msa_bench import sparse_formats as sf
from msa_bench.peer_steps import import_site_modules

#: The releases whose sources this module was written from.
FA4_VERSION = "4.0.0b40"
CUDNN_FE_VERSION = "1.32.0"
#: Query tokens per tile of the FA4 lists (its SM90 forward tile, = the MSA block here).
TILE = 128
#: The modules each peer needs.
PEER_MODULES = {
    "fa4": ("cutlass", "cutlass.cute", "flash_attn.cute.interface",
            "flash_attn.cute.block_sparsity", "flash_attn.cute.utils"),
    "cudnn_flex": ("cutlass", "cudnn.flex_attention"),
    "cudnn_bsa": ("cutlass", "cudnn.block_sparse_attention.api"),
}
PEER_MODULES["fa4_union"] = PEER_MODULES["fa4"]
#: Which sides compute MSA's function (checked against ours before timing).
EXACT = {"ours": True, "fa4": True, "fa4_union": False, "cudnn_flex": True,
         "cudnn_bsa": False, "cudnn_dense": False}


class PeerImportError(RuntimeError):
    """A peer's package cannot be imported; ``missing`` names the module."""

    def __init__(self, missing: str, detail: str):
        self.missing = missing
        super().__init__(f"cannot import a block-sparse peer: {detail} (missing module: "
                         f"{missing}; install the wheels of benchmarks/peer_wheels.sh with pip "
                         f"--target DIR and pass DIR as --site)")


def import_peers(names, site_dirs=()) -> dict:
    """The modules of the peers ``names`` (``fa4``, ``fa4_union``, ``cudnn_flex``,
    ``cudnn_bsa``) after adding
    ``site_dirs`` with ``site.addsitedir``.

    Returns:
        ``{name: namespace}``, or for a peer that does not import, ``{name: PeerImportError}``
        (the run goes on with the others and records why).
    """
    found = {}
    for name in names:
        try:
            import_site_modules(site_dirs, PEER_MODULES[name], PeerImportError)
        except PeerImportError as exc:
            found[name] = exc
            continue
        if name.startswith("fa4"):
            import cutlass
            import cutlass.cute as cute
            from flash_attn.cute import utils
            from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
            from flash_attn.cute.interface import flash_attn_func
            found[name] = SimpleNamespace(cutlass=cutlass, cute=cute, utils=utils,
                                          BlockSparseTensorsTorch=BlockSparseTensorsTorch,
                                          flash_attn_func=flash_attn_func)
        elif name == "cudnn_flex":
            from cudnn.flex_attention import create_mask_plan, flex_attn_func
            found[name] = SimpleNamespace(create_mask_plan=create_mask_plan,
                                          flex_attn_func=flex_attn_func)
        else:
            from cudnn.block_sparse_attention import api
            found[name] = SimpleNamespace(forward=api.block_sparse_attention_forward,
                                          backward=api.block_sparse_attention_backward)
    return found


def fa4_mask_mod(fa4, group: int, block: int):
    """FA4's ``mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)``: key ``kv_idx``
    is visible to query ``q_idx`` of query head ``head`` when its block is among the token's
    selected blocks on KV head ``head // group`` (bit ``blk % 32`` of word ``blk // 32`` of
    ``aux_tensors[0][head // group, q_idx]``, :func:`msa_bench.sparse_formats.membership_bits`)
    and ``kv_idx <= q_idx``. :func:`msa_bench.sparse_formats.mask_mod_reference` is the same
    arithmetic in torch.

    FA4 calls it per score element of the mask blocks only (``mask.py``, the "FlexAttention
    mask mod" branch of ``apply_mask``); full blocks are computed unmasked.
    """
    cutlass, cute, utils = fa4.cutlass, fa4.cute, fa4.utils
    if block & (block - 1):
        raise ValueError(f"block={block}: the mask_mod shifts by log2(block), a power of two")
    shift = block.bit_length() - 1

    @cute.jit
    def msa_mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        bits = aux_tensors[0]
        blk = kv_idx[0] >> shift
        word = bits[head[0] // group, q_idx[0], blk >> 5]
        selected = utils.scalar_to_ssa((word >> (blk & 31)) & 1, cutlass.Int32)
        return (selected == utils.scalar_to_ssa(1, cutlass.Int32)) & (kv_idx <= q_idx)

    return msa_mask_mod


@dataclass
class Side:
    """One side of the comparison on one selection.

    Attributes:
        name: the side's key in the rows.
        call: ``(part, q, k, v) -> out``: the side on part ``part``'s tensors, in its layout.
        parts: per call, the query-head and KV-head slices it takes.
        batched: the side takes and returns [1, T, H, d] (else compact [T, H, d]).
        exact: it computes MSA's function (checked against ours before timing).
        info: what the side reports besides times (its computed pairs, the union, ...).
    """

    name: str
    call: Callable
    parts: list
    batched: bool
    exact: bool
    info: dict = field(default_factory=dict)

    def prepare(self, q, k, v, dout):
        """Fresh leaves (clones with gradients) and output gradients per part."""
        leaves, douts = [], []
        for hq, hkv in self.parts:
            part = {}
            for name, x, heads in (("q", q, hq), ("k", k, hkv), ("v", v, hkv)):
                y = x[:, heads].clone(memory_format=torch.contiguous_format)
                part[name] = (y[None] if self.batched else y).requires_grad_()
            leaves.append(part)
            d = dout[:, hq].clone(memory_format=torch.contiguous_format)
            douts.append(d[None] if self.batched else d)
        return leaves, douts

    def forward(self, leaves) -> list:
        """Each part's output, with its autograd graph."""
        return [self.call(i, p["q"], p["k"], p["v"]) for i, p in enumerate(leaves)]

    def compact(self, leaves, outs) -> dict:
        """``{"out", "dq", "dk", "dv"}`` [T, H, d], the parts joined (gradients where the
        backward ran)."""
        def join(xs):
            return torch.cat([x[0] if self.batched else x for x in xs], dim=1)

        res = {"out": join([o.detach() for o in outs])}
        if leaves[0]["q"].grad is not None:
            for n in "qkv":
                res[f"d{n}"] = join([p[n].grad for p in leaves])
        return res


#: One call over every head.
WHOLE = [(slice(None), slice(None))]


def per_kv_head(hq: int, hkv: int) -> list:
    """One call per KV head with its query heads."""
    g = hq // hkv
    return [(slice(i * g, (i + 1) * g), slice(i, i + 1)) for i in range(hkv)]


def ours_side(q2k, msa, scale: float, backend: str) -> Side:
    """The project's op on the selection."""
    from nemo_msa import sparse_attention

    def call(_part, q, k, v):
        return sparse_attention(q, k, v, q2k, msa, softmax_scale=scale, backend=backend)

    return Side("ours", call, WHOLE, batched=False, exact=True)


def dense_side(msa, scale: float) -> Side:
    """cuDNN SDPA, causal, GQA, per document (the baseline)."""
    from layer_bench.steps import cudnn_document_attention

    lengths = [int(n) for n in msa.document_lengths]

    def call(_part, q, k, v):
        return cudnn_document_attention(q, k, v, lengths, scale)

    return Side("cudnn_dense", call, WHOLE, batched=False, exact=False)


def fa4_kwargs(fa4, tensors: dict, bits, group: int, block: int, scale: float) -> dict:
    """``flash_attn_func``'s keyword arguments for the lists ``tensors``
    (:func:`msa_bench.sparse_formats.fa4_block_sparse`): with the membership bitmask ``bits``
    the ``mask_mod`` (MSA's function), without it ``causal=True`` (the union bound)."""
    make = fa4.BlockSparseTensorsTorch
    fwd, bwd = (make(mask_block_cnt=x[0], mask_block_idx=x[1], full_block_cnt=x[2],
                     full_block_idx=x[3], block_size=(TILE, block))
                for x in (tensors["fwd"], tensors["bwd"]))
    kwargs = dict(softmax_scale=scale, pack_gqa=False, block_sparse_tensors=fwd,
                  block_sparse_tensors_bwd=bwd)
    if bits is None:
        kwargs["causal"] = True
    else:
        bits.__leading_dim__ = 2  # its word axis is contiguous (FA4's aux-tensor convention)
        kwargs.update(mask_mod=fa4_mask_mod(fa4, group, block), aux_tensors=[bits])
    return kwargs


def fa4_side(fa4, q2k, msa, hq: int, scale: float, bound: bool) -> Side:
    """FA4's block-sparse attention on the selection's tile unions: with the membership
    ``mask_mod`` (``bound=False``, MSA's function) or over the whole union (``bound=True``)."""
    t = sf.one_document_tokens(msa)
    block = msa.block_size
    if block != TILE:
        raise ValueError(f"block_size={block}: FA4's SM90 block-sparse key block is its tile_n "
                         f"{TILE}")
    group = hq // q2k.shape[0]
    lists = sf.tile_block_lists(q2k, msa, TILE)
    if bound:
        lists = sf.union_bound_lists(lists, TILE, block)
    tensors = sf.fa4_block_sparse(lists, group)
    bits = None if bound else sf.membership_bits(q2k, msa)
    kwargs = fa4_kwargs(fa4, tensors, bits, group, block, scale)

    def call(_part, q, k, v):
        return fa4.flash_attn_func(q, k, v, **kwargs)[0]

    pairs = sf.union_pairs(lists, t, TILE, block)
    info = {"computed_pairs": pairs["computed"],
            "union_mean": lists["union"].sum(-1).float().mean().item(),
            "full_share": (lists["full"].sum() / lists["union"].sum().clamp_min(1)).item()}
    if bound:
        info["bound_pairs"] = pairs["causal"]
    name = "fa4_union" if bound else "fa4"
    return Side(name, call, WHOLE, batched=True, exact=not bound, info=info)


def cudnn_flex_side(cudnn, q2k, msa, q, k, v, scale: float) -> Side:
    """cuDNN-FE's flex attention with the selection's interval mask, one plan and call per KV
    head (the plans are built here from ``q``, ``k``, ``v``'s shapes, outside the timing)."""
    t = sf.one_document_tokens(msa)
    func = sf.interval_mask(q2k, msa)
    sf.check_intervals(func, t)
    parts = per_kv_head(q.shape[1], k.shape[1])
    plans = []
    for g, (qs, ks) in enumerate(parts):
        # A plan reads its inputs' geometry, dtype and device only: contiguous stand-ins shaped
        # like a part's leaves.
        sample = [torch.empty_like(x[:, s][None], memory_format=torch.contiguous_format)
                  for x, s in ((q, qs), (k, ks), (v, ks))]
        plans.append(cudnn.create_mask_plan(func[g:g + 1].contiguous(), *sample,
                                            build_backward=True))

    def call(part, qg, kg, vg):
        return cudnn.flex_attn_func(qg, kg, vg, mask_plan=plans[part], softmax_scale=scale)

    return Side("cudnn_flex", call, parts, batched=True, exact=True,
                info={"nfunc": int(func.shape[1])})


class _BlockSparseFunction(torch.autograd.Function):
    """cuDNN-FE's block-sparse attention with autograd: its forward with GQA; its backward on
    K/V repeated over the query heads (it takes no GQA), dK/dV summed over each group."""

    @staticmethod
    def forward(ctx, q, k, v, bsa, index, counts, scale):
        out, lse = bsa.forward(q, k, v, index, q2k_block_nums=counts, sparse_block_size=TILE,
                               softmax_scale=scale, layout="bshd")
        ctx.save_for_backward(q, k, v, out, lse, index, counts)
        ctx.bsa, ctx.scale = bsa, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, index, counts = ctx.saved_tensors
        group = q.shape[2] // k.shape[2]
        kx, vx = (x.repeat_interleave(group, dim=2) for x in (k, v))
        dq, dk, dv = ctx.bsa.backward(dout.contiguous(), q, kx, vx, out, lse, index,
                                      q2k_block_nums=counts, sparse_block_size=TILE,
                                      softmax_scale=ctx.scale, layout="bshd")
        b, t, hkv, d = k.shape
        dk, dv = (x.view(b, t, hkv, group, d).sum(3) for x in (dk, dv))
        return dq, dk, dv, None, None, None, None


def cudnn_bsa_side(bsa, q2k, msa, hq: int, scale: float) -> Side:
    """cuDNN-FE's block-sparse attention over each 128-token tile's union (non-causal: a bound,
    not MSA's function)."""
    t = sf.one_document_tokens(msa)
    if msa.block_size != TILE:
        raise ValueError(f"block_size={msa.block_size}: the cuDNN-FE path runs 128-token "
                         f"blocks ({TILE})")
    group = hq // q2k.shape[0]
    lists = sf.tile_block_lists(q2k, msa, TILE)
    count, index = sf.pack_lists(lists["union"])
    count, index = (x.repeat_interleave(group, dim=0).unsqueeze(0).contiguous()
                    for x in (count, index))

    def call(_part, q, k, v):
        return _BlockSparseFunction.apply(q, k, v, bsa, index, count, scale)

    pairs = sf.union_pairs(lists, t, TILE, TILE)["computed"]
    return Side("cudnn_bsa", call, WHOLE, batched=True, exact=False,
                info={"computed_pairs": pairs, "bound_pairs": pairs})
