"""MSA sparse attention dk/dv for Hopper (SM90) in Gluon: TMA rows, warp-specialized.

The same function as the Triton dk/dv kernel of :mod:`nemo_msa.attention.triton_bwd` (which
stays the interpreter's and every other GPU's path; on the same inputs the two agree bit for
bit), organised the way FlashAttention-3 organises its backward on Hopper (ADR 0042):

* one program per (KV head, key block); its consumer partition is two warpgroups that own 64 of
  the block's 128 keys each and share every query tile, so a query row is read once per block
  (the Triton kernel splits a block over two programs that each read it);
* a producer warp sends for the query side of each step (``QT`` tokens x the ``G`` heads of
  the group: q and dO rows, the rows' log2-domain LSE and delta, token-major, and the tokens'
  positions) by TMA, one bulk copy per token and tensor, into a ring of three slots, and takes
  a slot back when the consumers release it; the consumers never wait on an index load and
  never stop at the barriers that TMA issue costs in a single partition;
* every product is a warpgroup MMA in the transposed form ``S^T = K Q^T``,
  ``dP^T = V dO^T``: ``P^T`` and ``dS^T`` are those products' accumulators and feed
  ``dV += P^T dO`` and ``dK += dS^T Q`` from registers, so nothing is transposed through
  shared memory; a step's dK product runs while the next step's S^T is computed.

Rows past a list's end read the zeros TMA returns past the tensors (q = dO = 0 and LSE = delta
= 0: they add nothing). Non-finite rows follow ADR 0025 exactly as the Triton kernel does: a
row whose delta is not finite gets delta 0 and a NaN LSE (applied to the token-major copies
here, per row, where the Triton kernel applies it per step).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from nemo_msa.backends.capabilities import GLUON_DKDV
from nemo_msa.triton.tiles import LOG2E, tma_rows

__all__ = ["GLUON_DKDV_WARPS", "descriptor_blocks", "gluon_dkdv", "gluon_dkdv_inputs_reason",
           "gluon_dkdv_supported", "row_stats"]

#: Warps of the dk/dv program's consumer partition: two warpgroups, 64 keys each.
GLUON_DKDV_WARPS = 8
#: Registers of the producer warp.
PRODUCER_REGS = gl.constexpr(24)
#: The launch's register cap: registers are handed out by warpgroup, so the producer's warp
#: counts as 4 and every thread of the 12 warps gets at most this (the register file's 64 K
#: words, in multiples of 8) before the consumers raise theirs to what is left (240).
MAXNREG = 65536 // ((GLUON_DKDV_WARPS + 4) * 32) // 8 * 8


@gluon.jit
def _dkdv_producer(q_desc, do_desc, st_desc, pos_desc, q_bufs, do_bufs, st_bufs, pos_bufs,
                   ready, empty, list_ptr, lo, hi, head0, HQ, OOB, G: gl.constexpr,
                   D: gl.constexpr, SLOT: gl.constexpr, QT: gl.constexpr):
    """One warp: fills the ring, a slot as soon as the consumers release it. Per step, each of
    its ``QT`` list entries sends for its token's ``G`` heads of q and dO, their LSE and delta,
    and its position; entries past ``hi`` address row ``OOB`` (past the tensors: zeros). Shared
    memory takes TMA writes at 128-byte aligned addresses: the LSE/delta and the position of a
    token each fill one ``SLOT``-word slot."""
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    last = gl.maximum(hi - 1, 0)
    for s in range(gl.cdiv(hi - lo, QT)):
        slot = s % STAGES
        # A fresh barrier counts as having completed the phase before its first: the first
        # STAGES waits pass.
        mbarrier.wait(empty.index(slot), ((s // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, QT * (2 * G * D * 2 + 2 * G * 4 + G * 4))
        for i in gl.static_range(QT):
            e = lo + s * QT + i
            r = gl.where(e < hi, gl.load(list_ptr + gl.minimum(e, last)) * HQ + head0, OOB)
            tma.async_copy_global_to_shared(q_desc, [r, 0], bar,
                                            q_bufs.index(slot).slice(i * G, G))
            tma.async_copy_global_to_shared(do_desc, [r, 0], bar,
                                            do_bufs.index(slot).slice(i * G, G))
            # The row stats of (token, group) are 2 G floats at 2 (token * HQ + head0).
            tma.async_copy_global_to_shared(st_desc, [2 * r], bar,
                                            st_bufs.index(slot).slice(i * SLOT, 2 * G))
            # A token's position is repeated G times at token * G (OOB / HQ * G is past them).
            tma.async_copy_global_to_shared(pos_desc, [r // HQ * G], bar,
                                            pos_bufs.index(slot).slice(i * SLOT, G))


@gluon.jit
def _dkdv_consumer(k_smem, v_smem, q_bufs, do_bufs, st_bufs, pos_bufs, ready, empty, kv_bar,
                   lo, hi, b, scale_log2, G: gl.constexpr, QT: gl.constexpr, BS: gl.constexpr,
                   D: gl.constexpr, SLOT: gl.constexpr):
    """Two warpgroups (64 keys each): the products of every step; returns fp32 (dK / scale,
    dV) [BS, D]."""
    BM: gl.constexpr = QT * G
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    # A step's LSE, delta and position slots read as [BM] row vectors through this padded view
    # (row r at word (r // G) * SLOT + r % G of the slots).
    row_view: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[G, SLOT - G]], [BM], [0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    # The same words as rows of G: row 2 (stage QT + i) + 1 starts the delta half of token i's
    # slot, from which the padded view reads the step's delta as it reads the LSE.
    st_words = st_bufs._reinterpret(gl.float32, [STAGES * 2 * QT, G],
                                    gl.SwizzledSharedLayout(1, 1, 1, [0]))
    dk = gl.zeros([BS, D], gl.float32, acc_layout)
    dv = gl.zeros([BS, D], gl.float32, acc_layout)
    kpos = b * BS + gl.arange(0, BS, layout=gl.SliceLayout(1, s_layout))
    mbarrier.wait(kv_bar, 0)
    for s in range(gl.cdiv(hi - lo, QT)):
        stage = s % STAGES
        q_s = q_bufs.index(stage)
        do_s = do_bufs.index(stage)
        mbarrier.wait(ready.index(stage), (s // STAGES) & 1)
        st = warpgroup_mma(k_smem, q_s.permute((1, 0)), gl.zeros([BS, BM], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)),
                            gl.zeros([BS, BM], gl.float32, s_layout), use_acc=False,
                            is_async=True)
        lse2 = st_bufs.index(stage)._reinterpret(gl.float32, [BM], row_view).load(row_layout)
        # In order: the previous step's dV / dK products are done with S^T, so the previous
        # step's slot goes back to the producer.
        st = warpgroup_mma_wait(1, deps=(st,))
        mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), pred=s > 0)
        pos = pos_bufs.index(stage)._reinterpret(gl.int32, [BM], row_view).load(row_layout)
        vis = kpos[:, None] <= pos[None, :]
        pt = gl.where(vis, gl.exp2(st * scale_log2 - lse2[None, :]), 0.0)
        delta = st_words.index(stage * 2 * QT + 1)._reinterpret(gl.float32, [BM], row_view).load(
            row_layout)
        # The slot's words are read: order those reads before the producer's next TMA into it.
        fence_async_shared()
        dpt = warpgroup_mma_wait(0, deps=(dpt,))
        dsa = gl.convert_layout((pt * (dpt - delta[None, :])).to(gl.bfloat16), a_layout)
        pa = gl.convert_layout(pt.to(gl.bfloat16), a_layout)
        dv = warpgroup_mma(pa, do_s, dv, is_async=True)
        dk = warpgroup_mma(dsa, q_s, dk, is_async=True)
        # dV is done and dK stays in flight into the next step (the next products only
        # accumulate into them, in order). Leaving both in flight (a wait for 2) made ptxas
        # serialize every warpgroup MMA for lack of registers (C7512): 2-5% slower (ADR 0045).
        dv, dk = warpgroup_mma_wait(1, deps=(dv, dk))
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    return dk, dv


@gluon.jit
def _dkdv_sm90_kernel(
    q_desc, do_desc, k_desc, v_desc, st_desc, pos_desc, dk_ptr, dv_ptr,
    offsets_ptr, list_ptr, order_ptr, block_doc_ptr, block_local_ptr, cu_ptr,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, num_blocks_bound, HQ, OOB,
    scale, scale_log2,
    G: gl.constexpr, QT: gl.constexpr, BS: gl.constexpr, D: gl.constexpr,
):
    BM: gl.constexpr = QT * G
    STAGES: gl.constexpr = 3
    SLOT: gl.constexpr = 32
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, D, 16])
    seg = gl.load(order_ptr + gl.program_id(0))
    g = seg // num_blocks_bound
    blk = seg % num_blocks_bound
    doc = gl.load(block_doc_ptr + blk)
    if doc >= 0:
        start = gl.load(cu_ptr + doc)
        length = gl.load(cu_ptr + doc + 1) - start
        b = gl.load(block_local_ptr + blk)
        lo = gl.load(offsets_ptr + seg).to(gl.int32)
        hi = gl.load(offsets_ptr + seg + 1).to(gl.int32)

        k_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], v_desc.layout)
        q_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, D], q_desc.layout)
        do_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, D], do_desc.layout)
        st_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, QT * SLOT], st_desc.layout)
        pos_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, QT * SLOT], pos_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(kv_bar, count=1)

        key_row = start + b * BS
        mbarrier.expect(kv_bar, 2 * BS * D * 2)
        tma.async_copy_global_to_shared(k_desc, [key_row, g * D], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [key_row, g * D], kv_bar, v_smem)

        dk, dv = gl.warp_specialize([
            (_dkdv_consumer, (k_smem, v_smem, q_bufs, do_bufs, st_bufs, pos_bufs, ready, empty,
                              kv_bar, lo, hi, b, scale_log2, G, QT, BS, D, SLOT)),
            (_dkdv_producer, (q_desc, do_desc, st_desc, pos_desc, q_bufs, do_bufs, st_bufs,
                              pos_bufs, ready, empty, list_ptr, lo, hi, g * G, HQ, OOB, G, D,
                              SLOT, QT)),
        ], [1], [PRODUCER_REGS])

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        mbarrier.invalidate(kv_bar)
        keys = b * BS + gl.arange(0, BS, layout=gl.SliceLayout(1, acc_layout))
        rows = (start + keys).to(gl.int64)
        dd = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        kmask = (keys < length)[:, None]
        gl.store(dk_ptr + rows[:, None] * stride_dkt + g * stride_dkh + dd[None, :],
                 (dk * scale).to(dk_ptr.dtype.element_ty), mask=kmask)
        gl.store(dv_ptr + rows[:, None] * stride_dvt + g * stride_dvh + dd[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=kmask)


def row_stats(lse: torch.Tensor, delta: torch.Tensor, token_pos: torch.Tensor,
              kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query side's per-row words as the kernel's TMA boxes read them.

    Args:
        lse: fp32 [Hq, T] natural-log LSE of the forward.
        delta: fp32 [Hq, T] rowsum(dO * O).
        token_pos: int [T] document position of each query row.
        kv_heads: Hkv (query heads ``g G .. g G + G - 1`` share KV head ``g``, G = Hq / Hkv).

    Returns:
        ``(stats, positions)``: fp32 [T Hkv 2 G] with row (t, g G + i)'s log2-domain LSE at
        ``2 (t Hq + g G) + i`` and its delta ``G`` words further (a row whose delta is not finite
        gets delta 0 and a NaN LSE, ADR 0025); int32 [T G] with t's position at
        ``t G .. t G + G - 1``.
    """
    hq, t = lse.shape
    group = hq // kv_heads
    ok = torch.isfinite(delta)
    lse2 = torch.where(ok, lse * LOG2E, float("nan"))
    stats = torch.stack([lse2.t().reshape(t, kv_heads, group),
                         torch.where(ok, delta, 0.0).t().reshape(t, kv_heads, group)], dim=2)
    positions = token_pos.to(torch.int32)[:, None].expand(t, group).contiguous()
    return stats.view(-1), positions.view(-1)


def descriptor_blocks(group: int, head_dim: int, block_size: int) -> dict:
    """The kernel's six TMA descriptors as ``name -> (element dtype, block shape, shared
    layout)``: what :func:`gluon_dkdv` builds and ``benchmarks/kernel_report.py`` compiles."""
    rows = gl.NVMMASharedLayout.get_default_for([group, head_dim], gl.bfloat16)
    keys = gl.NVMMASharedLayout.get_default_for([block_size, head_dim], gl.bfloat16)
    word = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    return {"q_desc": ("bf16", [group, head_dim], rows),
            "do_desc": ("bf16", [group, head_dim], rows),
            "k_desc": ("bf16", [block_size, head_dim], keys),
            "v_desc": ("bf16", [block_size, head_dim], keys),
            "st_desc": ("fp32", [2 * group], word), "pos_desc": ("i32", [group], word)}


def gluon_dkdv_inputs_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             dout: torch.Tensor) -> str | None:
    """Why :func:`gluon_dkdv` cannot read these tensors as they are laid out (None when it
    can): q and dO dense ([T, Hq, d] contiguous, 16-byte aligned), k and v with dense rows of
    heads ([T, Hkv, d] with the head and dim strides of a contiguous tensor), and
    2 T Hq < 2^31 (the kernel's TMA coordinates are int32). What it takes of the layer (the
    GPU, dtype, head dim, block size, group) is
    :data:`~nemo_msa.backends.capabilities.GLUON_DKDV`, which the plan asks."""
    t, hq, _ = q.shape
    if not 0 < 2 * t * hq < 2**31:
        return f"2 T Hq = {2 * t * hq} rows: the kernel's TMA coordinates are int32"
    for name, x in (("q", q), ("dout", dout)):
        if not x.is_contiguous() or x.data_ptr() % 16:
            return f"{name} is not a dense, 16-byte aligned [T, Hq, d] tensor"
    for name, x in (("k", k), ("v", v)):
        if not tma_rows(x):
            return f"{name} has no dense, 16-byte aligned rows of heads"
    return None


def gluon_dkdv_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         dout: torch.Tensor, group: int, block_size: int) -> bool:
    """Whether :func:`gluon_dkdv` takes these inputs: the layer's part is
    :data:`~nemo_msa.backends.capabilities.GLUON_DKDV` (a tested Triton, an SM90 GPU, bf16,
    head dim 128, block 128, 16 query heads per KV head), the tensors' part
    :func:`gluon_dkdv_inputs_reason`."""
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    return GLUON_DKDV.why_not(
        compute_capability=capability, dtype=q.dtype, head_dim=q.shape[-1],
        block_size=block_size, group=group, triton_version=triton.__version__,
    ) is None and gluon_dkdv_inputs_reason(q, k, v, dout) is None


def gluon_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
               lse: torch.Tensor, delta: torch.Tensor, csr, view, token_pos: torch.Tensor,
               scale: float, block_size: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """dk and dv of the sparse attention into ``dk`` and ``dv`` (written in full).

    Args:
        q: bf16 [T, Hq, 128] contiguous. ``dout`` likewise.
        k, v: bf16 [T, Hkv, 128] with dense rows of heads (see :func:`gluon_dkdv_supported`).
        lse: fp32 [Hq, T] natural-log LSE of the forward.
        delta: fp32 [Hq, T] rowsum(dO * O) (the dq kernel's).
        csr: the :class:`~nemo_msa.triton.kernel_layout.BlockQueryCSR` of the selection.
        view: the layout's :class:`~nemo_msa.triton.kernel_layout.KernelLayout`.
        token_pos: int32 [T] document position of each query row of the lists.
        scale: the softmax scale.
        block_size: 128.
        dk, dv: k's and v's shapes and dtypes; every row is written.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    stats, positions = row_stats(lse, delta, token_pos, hkv)
    rows = t * hq
    blocks = {name: (shape, layout) for name, (_, shape, layout)
              in descriptor_blocks(group, d, block_size).items()}

    def descriptor(name, x, shape, strides):
        return TensorDescriptor(x, shape, strides, *blocks[name])

    q_desc = descriptor("q_desc", q.view(rows, d), [rows, d], [d, 1])
    do_desc = descriptor("do_desc", dout.view(rows, d), [rows, d], [d, 1])
    k_desc = descriptor("k_desc", k, [k.shape[0], hkv * d], [k.stride(0), 1])
    v_desc = descriptor("v_desc", v, [v.shape[0], hkv * d], [v.stride(0), 1])
    st_desc = descriptor("st_desc", stats, [stats.numel()], [1])
    pos_desc = descriptor("pos_desc", positions, [positions.numel()], [1])
    _dkdv_sm90_kernel[(hkv * view.num_blocks_bound,)](
        q_desc, do_desc, k_desc, v_desc, st_desc, pos_desc, dk, dv,
        csr.offsets, csr.tokens, csr.order, view.block_doc, view.block_local, view.cu_seqlens,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        view.num_blocks_bound, hq, rows, scale, scale * LOG2E,
        G=group, QT=4, BS=block_size, D=d, num_warps=GLUON_DKDV_WARPS, maxnreg=MAXNREG,
    )
