"""MSA sparse attention dq for Hopper (SM90) in Gluon, key-major: each key block's K and V are
read once for every query row that selected it, and dq is added by fp32 atomics (ADR 0044).

The dq kernels of :mod:`nemo_msa.attention.triton_bwd` are query-major: a per-token program
reads 64 KiB of K and V for each (token, selected block) to serve the token's 16 query rows, and
on random selections that read bounds them (ADR 0035). This kernel walks the other way, over
the same key-major lists as the dk/dv kernel (:mod:`nemo_msa.attention.gluon_dkdv`): one
program per (KV head, key block, chunk of the block's list) holds the block's K and V in shared
memory, and per step of ``QT`` listed tokens (``QT G`` = 128 query rows, read by TMA by the dk/dv
kernel's producer warp) its consumer warpgroups compute

* ``S = Q K^T`` and ``dP = dO V^T`` ([128 rows, 128 keys] each; both warpgroup MMAs in flight
  at once), ``P = exp2(S log2e scale - LSE2)`` where the key is visible, ``dS = P (dP - delta)``;
* ``dq / scale += dS K`` from registers (dS is that product's A operand) and adds the [128, d]
  fp32 product to the token rows of an fp32 buffer with relaxed atomics.

The fp32 sums arrive in the order the programs reach them: the same function as the dq kernels,
not the same bits run to run; the backward runs the dq kernels under
``torch.use_deterministic_algorithms(True)``. Non-finite values follow ADR 0025 as the fused
experiment of ADR 0043 did: K's non-finite rows are zeroed in shared memory (a row that sees one
has a NaN LSE, so its probabilities are NaN on every pair it sees whatever S is, and a row that
does not must not add 0 * NaN), and dS is 0 wherever P is.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from nemo_msa.attention.gluon_dkdv import (
    MAXNREG,
    PRODUCER_REGS,
    invalidate_ring,
    key_block_and_query_ring,
    query_rows_producer,
    query_side_descriptors,
)
from nemo_msa.triton.tiles import LOG2E

__all__ = ["GLUON_DQ_WARPS", "gluon_dq", "gluon_dq_chunks"]

#: Warps of the consumer partition: two warpgroups, 64 of a step's 128 query rows each.
GLUON_DQ_WARPS = 8
#: Tokens per step: ``QT G`` = 128 query rows at the 16 heads of a group.
QT_TOKENS = 8


@gluon.jit
def _zero_nonfinite_keys(k_smem, BS: gl.constexpr, D: gl.constexpr):
    """Zeroes the key rows of ``k_smem`` that hold a NaN/Inf and orders the stores before the
    warpgroups' MMAs read it (see the module docstring)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    k = k_smem.load(layout)
    finite = gl.min(gl.where(gl.abs(k.to(gl.float32)) < float("inf"), 1, 0), axis=1)
    k_smem.store(gl.where(finite[:, None] != 0, k, 0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _dq_consumer(k_smem, v_smem, q_bufs, do_bufs, st_bufs, pos_bufs, ready, empty, kv_bar,
                 dq_ptr, list_ptr, lo, hi, b, head0, HQ, scale_log2, G: gl.constexpr,
                 QT: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, SLOT: gl.constexpr):
    """Two warpgroups (64 query rows each): every step's three products and its atomic adds of
    ``dq / scale`` into ``dq_ptr`` (fp32 [T Hq, D]); rows past ``hi`` add nothing."""
    BM: gl.constexpr = QT * G
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    # A step's LSE, delta and position slots read as [BM] row vectors through this padded view
    # (row r at word (r // G) * SLOT + r % G of the slots).
    row_view: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[G, SLOT - G]], [BM], [0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, BS, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    # The same words as rows of G: row 2 (stage QT + i) + 1 starts the delta half of token i's
    # slot, from which the padded view reads the step's delta as it reads the LSE.
    st_words = st_bufs._reinterpret(gl.float32, [STAGES * 2 * QT, G],
                                    gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kpos = b * BS + gl.arange(0, BS, layout=gl.SliceLayout(0, s_layout))
    r_acc = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    last = gl.maximum(hi - 1, 0)
    mbarrier.wait(kv_bar, 0)
    _zero_nonfinite_keys(k_smem, BS, D)
    for s in range(gl.cdiv(hi - lo, QT)):
        stage = s % STAGES
        q_s = q_bufs.index(stage)
        do_s = do_bufs.index(stage)
        mbarrier.wait(ready.index(stage), (s // STAGES) & 1)
        sc = warpgroup_mma(q_s, k_smem.permute((1, 0)), gl.zeros([BM, BS], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        dp = warpgroup_mma(do_s, v_smem.permute((1, 0)), gl.zeros([BM, BS], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        lse2 = st_bufs.index(stage)._reinterpret(gl.float32, [BM], row_view).load(row_layout)
        pos = pos_bufs.index(stage)._reinterpret(gl.int32, [BM], row_view).load(row_layout)
        delta = st_words.index(stage * 2 * QT + 1)._reinterpret(gl.float32, [BM], row_view).load(
            row_layout)
        e = lo + s * QT + r_acc // G
        tok = gl.load(list_ptr + gl.minimum(e, last))
        sc = warpgroup_mma_wait(1, deps=(sc,))
        p = gl.where(kpos[None, :] <= pos[:, None], gl.exp2(sc * scale_log2 - lse2[:, None]), 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        # Both products have read the slot and every warp has read its words: order those reads
        # before the producer's next TMA into it, and give it back.
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(empty.index(stage))
        ds = gl.where(p == 0.0, 0.0, p * (dp - delta[:, None]))
        dq = warpgroup_mma(gl.convert_layout(ds.to(gl.bfloat16), a_layout), k_smem,
                           gl.zeros([BM, D], gl.float32, acc_layout), use_acc=False,
                           is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        rows = (tok * HQ + head0 + r_acc % G).to(gl.int64)
        gl.atomic_add(dq_ptr + rows[:, None] * D + cols[None, :], dq, mask=(e < hi)[:, None],
                      sem="relaxed")


@gluon.jit
def _dq_sm90_kernel(
    q_desc, do_desc, k_desc, v_desc, st_desc, pos_desc, dq_ptr,
    offsets_ptr, ends_ptr, list_ptr, order_ptr, block_doc_ptr, block_local_ptr, cu_ptr,
    num_blocks_bound, HQ, OOB, scale_log2, CHUNKS,
    G: gl.constexpr, QT: gl.constexpr, BS: gl.constexpr, D: gl.constexpr,
):
    STAGES: gl.constexpr = 2
    SLOT: gl.constexpr = 32
    pid = gl.program_id(0)
    seg = gl.load(order_ptr + pid // CHUNKS)
    chunk = pid % CHUNKS
    g = seg // num_blocks_bound
    blk = seg % num_blocks_bound
    doc = gl.load(block_doc_ptr + blk)
    lo = gl.load(offsets_ptr + seg).to(gl.int32)
    hi = gl.load(ends_ptr + seg).to(gl.int32)
    # The chunk's whole steps of the list: a long list is spread over CHUNKS programs.
    per = gl.cdiv(gl.cdiv(hi - lo, QT), CHUNKS) * QT
    lo = lo + chunk * per
    hi = gl.minimum(hi, lo + per)
    if (doc >= 0) & (lo < hi):
        start = gl.load(cu_ptr + doc)
        b = gl.load(block_local_ptr + blk)

        k_smem, v_smem, q_bufs, do_bufs, st_bufs, pos_bufs, ready, empty, kv_bar = (
            key_block_and_query_ring(k_desc, v_desc, q_desc, do_desc, st_desc, pos_desc,
                                     start, b, g, STAGES, QT, G, SLOT, BS, D))

        gl.warp_specialize([
            (_dq_consumer, (k_smem, v_smem, q_bufs, do_bufs, st_bufs, pos_bufs, ready, empty,
                            kv_bar, dq_ptr, list_ptr, lo, hi, b, g * G, HQ, scale_log2, G, QT,
                            BS, D, SLOT)),
            (query_rows_producer, (q_desc, do_desc, st_desc, pos_desc, q_bufs, do_bufs,
                                   st_bufs, pos_bufs, ready, empty, list_ptr, lo, hi, g * G, HQ,
                                   OOB, G, D, SLOT, QT)),
        ], [1], [PRODUCER_REGS])

        invalidate_ring(ready, empty, kv_bar)


def gluon_dq_chunks(segments: int, device: torch.device) -> int:
    """Programs per (KV head, key block) list: enough that the grid fills the GPU about four
    times over (a causal document's early blocks have the longest lists; dq is added by atomics,
    so a list splits freely)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, -(-4 * sms // max(segments, 1)))


def gluon_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
             lse: torch.Tensor, delta: torch.Tensor, csr, view, token_pos: torch.Tensor,
             scale: float, block_size: int, dq_acc: torch.Tensor,
             descriptors: dict | None = None) -> None:
    """Adds ``dq / scale`` of the sparse attention into ``dq_acc``.

    Takes what :func:`~nemo_msa.attention.gluon_dkdv.gluon_dkdv_supported` accepts.

    Args:
        q: bf16 [T, Hq, 128] contiguous. ``dout`` likewise.
        k, v: bf16 [T, Hkv, 128] with dense rows of heads.
        lse: fp32 [Hq, T] natural-log LSE of the forward.
        delta: fp32 [Hq, T] rowsum(dO * O).
        csr: the :class:`~nemo_msa.triton.kernel_layout.BlockQueryCSR` of the selection; with
            leading entries (``csr.lead_end``) only those are walked, else every entry.
        view: the layout's :class:`~nemo_msa.triton.kernel_layout.KernelLayout`.
        token_pos: int32 [T] document position of each query row of the lists.
        scale: the softmax scale.
        block_size: 128.
        dq_acc: fp32 [T, Hq, 128] contiguous, zero on the walked rows; ``dS K`` of every walked
            (row, block) pair is added to it.
        descriptors: :func:`~nemo_msa.attention.gluon_dkdv.query_side_descriptors` of these
            inputs, or None to build them.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    if dq_acc.shape != q.shape or dq_acc.dtype != torch.float32 or not dq_acc.is_contiguous():
        raise ValueError(f"dq_acc must be contiguous fp32 {tuple(q.shape)}, got {dq_acc.dtype} "
                         f"{tuple(dq_acc.shape)}")
    if descriptors is None:
        descriptors = query_side_descriptors(q, k, v, dout, lse, delta, token_pos, block_size)
    segments = hkv * view.num_blocks_bound
    chunks = gluon_dq_chunks(segments, q.device)
    lead = csr.lead_end is not None
    _dq_sm90_kernel[(segments * chunks,)](
        **descriptors, dq_ptr=dq_acc, offsets_ptr=csr.offsets,
        ends_ptr=csr.lead_end if lead else csr.offsets[1:], list_ptr=csr.tokens,
        order_ptr=csr.lead_order if lead else csr.order, block_doc_ptr=view.block_doc,
        block_local_ptr=view.block_local,
        cu_ptr=view.cu_seqlens, num_blocks_bound=view.num_blocks_bound, HQ=hq, OOB=t * hq,
        scale_log2=scale * LOG2E, CHUNKS=chunks, G=hq // hkv, QT=QT_TOKENS, BS=block_size, D=d,
        num_warps=GLUON_DQ_WARPS, maxnreg=MAXNREG,
    )
