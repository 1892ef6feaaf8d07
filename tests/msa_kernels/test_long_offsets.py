"""Rows past 2^31 elements in the attention kernels and RoPE, at 32 tokens (ADR 0051).

q of one MiniMax-M3 layer ([T, 64, 128]) passes 2^31 elements past T = 262144, where an int32
row offset wraps. Here q, k, v, dO and O are views with a row stride of 2^27 elements into one
buffer: rows 16..31 of a 32-token layout start past 2^31 elements from each view's first
element, whatever the head count. The buffer takes memory only where it is written (a
MAP_NORESERVE mapping on the host: a page per row; a 13 GB allocation on a GPU), and 4 GiB of
it lie below the views, so that an offset wrapped in int32 reads there (zeros, or whatever a
GPU allocation held) instead of faulting: a kernel that drops an int64 cast fails by value.

The launchers take these strides as they are (they copy only a tensor whose last dim is not
contiguous), so the loads of every attention kernel (per-token and union forward and dq, the
Triton dk/dv, the NaN/Inf row counts) and of RoPE run at offsets past 2^31; the outputs are
the launchers' own allocations, whose stores the full-size GPU test covers
(tests/msa_kernels/test_long_sequences_gpu.py).

The interpreter keeps int32 arithmetic in int32 (numpy), as compiled code does; the first test
checks that premise, so that the others cannot pass by not looking.
"""

from __future__ import annotations

import math
import mmap
import sys

import pytest
import torch
import triton
import triton.language as tl
from _msa_support import KERNEL_DEVICE, layout_on_kernel_device, make_layout, random_q2k

from nemo_msa.attention.triton_bwd import triton_attention_backward
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.testing.oracle import attention_grads_f64, rel_err
from nemo_msa.triton.rope import rope_triton
from nemo_msa.triton.tiles import advance

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") and KERNEL_DEVICE == "cpu",
                                reason="the host buffer is a Linux MAP_NORESERVE mapping")

#: Row stride of every view (elements): row 16 starts at 2^31, row 31 below 2^32 (one wrap).
STRIDE = 1 << 27
#: The layout: documents of 9 and 23 tokens, blocks of 16 (the second one has a whole block
#: and a partial one; rows 16..31, past 2^31, are its positions 7..22).
DOCS, BS = [9, 23], 16
TOKENS = sum(DOCS)
#: Bytes below the views: an int32 offset that wrapped lands at most 2^32 bytes (bf16) below.
BELOW = 1 << 32
#: Per-token forward and dq for the tiles whose union has two blocks, the union kernels for the
#: rest (tiles of the first block, and the 9-token document).
MIXED = {"fwd.union_qt": 4, "fwd.union_max": 1, "bwd.dq_union_qt": 4, "bwd.dq_union_max": 1}
TOL = 1e-2  # bf16 operands against float64 (MSA_SPEC.md)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value where mmap lacks it


class WideRows:
    """bf16 [rows, heads, d] views with a row stride of :data:`STRIDE` elements, side by side in
    one buffer that holds :data:`BELOW` bytes under the first view (see the module docstring).
    """

    def __init__(self, rows: int, shapes: list[tuple[int, int]]):
        nbytes = BELOW + rows * STRIDE * 2
        if KERNEL_DEVICE == "cpu":
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                  | _MAP_NORESERVE)
            raw = torch.frombuffer(self._map, dtype=torch.uint8)
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8, device=KERNEL_DEVICE)
        buffer = raw.view(torch.bfloat16)
        first = at = BELOW // 2
        self.views = []
        for heads, d in shapes:
            self.views.append(buffer.as_strided((rows, heads, d), (STRIDE, d, 1), at))
            at += heads * d
        # Every view's row r lies in the same page: the rows cost a page each, not more.
        assert (at - first) * 2 <= 4096, shapes


@triton.jit
def _copy_rows(src_ptr, dst_ptr, stride, WIDE: tl.constexpr, D: tl.constexpr):
    """dst[row] = src[row, 0, :D] for row = program_id, the row offset in int64 when WIDE."""
    row = tl.program_id(0)
    dd = tl.arange(0, D)
    if WIDE:
        x = tl.load(advance(src_ptr, row, stride) + dd)
    else:
        x = tl.load(src_ptr + row * stride + dd)
    tl.store(dst_ptr + row * D + dd, x)


def test_an_int32_row_offset_wraps_here():
    # The premise of the tests below: where the kernels run (compiled, or the interpreter), an
    # int32 row times an int32 stride wraps past 2^31, and the int64 base does not.
    (src,) = WideRows(TOKENS, [(1, 16)]).views
    values = torch.arange(1, TOKENS * 16 + 1).view(TOKENS, 1, 16).to(torch.bfloat16)  # not 0
    src.copy_(values)
    values = values.float()
    for wide in (True, False):
        dst = torch.zeros(TOKENS, 16, dtype=torch.bfloat16, device=KERNEL_DEVICE)
        _copy_rows[(TOKENS,)](src, dst, STRIDE, WIDE=wide, D=16)
        got = dst.float().cpu()
        assert torch.equal(got[:16], values[:16, 0]), wide  # below 2^31 both agree
        assert torch.equal(got[16:], values[16:, 0]) == wide, wide


def test_attention_reads_rows_past_2_31_elements(set_launch):
    set_launch(MIXED)
    hq, hkv, d = 2, 1, 16
    gen = torch.Generator().manual_seed(0)
    msa_h = make_layout([DOCS], TOKENS, BS)
    msa = layout_on_kernel_device(msa_h)
    heads = (hq, hkv, hkv, hq, hq)  # q, k, v, dO and the slot O is copied into
    q, k, v, dout, o_slot = WideRows(TOKENS, [(h, d) for h in heads]).views
    host = [torch.randn(TOKENS, h, d, generator=gen).to(torch.bfloat16) for h in heads[:4]]
    for view, x in zip((q, k, v, dout), host, strict=True):
        view.copy_(x.to(KERNEL_DEVICE))
    q2k = random_q2k(msa_h, hkv, 2, BS, gen)
    scale = 1.0 / math.sqrt(d)
    dq2k = q2k.to(KERNEL_DEVICE)
    out, lse = triton_attention_forward(q, k, v, dq2k, msa, scale)
    o_slot.copy_(out)  # the backward reads O (for delta) past 2^31 too
    dq, dk, dv = triton_attention_backward(dout, q, k, v, o_slot, lse, dq2k, msa, scale)
    ref = attention_grads_f64(*host[:3], q2k, msa_h, scale, BS, host[3])
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref,
                               strict=True):
        got = got.float().cpu()
        # Rows 16.. (past 2^31) alone: an error there is not diluted by the rows below.
        past = (slice(None), slice(16, None)) if name == "lse" else slice(16, None)
        assert rel_err(got[past], want[past]) < TOL, name
        assert rel_err(got, want) < TOL, name


def test_rope_reads_rows_past_2_31_elements():
    gen = torch.Generator().manual_seed(1)
    heads, dim, rot = 4, 32, 16
    (t,) = WideRows(TOKENS, [(heads, dim)]).views
    host = torch.randn(TOKENS, heads, dim, generator=gen).to(torch.bfloat16)
    t.copy_(host.to(KERNEL_DEVICE))
    angles = torch.randn(TOKENS, 1, rot // 2, generator=gen).repeat(1, 1, 2)
    cos = angles.cos().to(torch.bfloat16).to(KERNEL_DEVICE)
    sin = torch.cat([-angles[..., : rot // 2].sin(), angles[..., rot // 2:].sin()], -1)
    sin = sin.to(torch.bfloat16).to(KERNEL_DEVICE)
    for backward in (False, True):
        got = rope_triton(t, cos, sin, backward=backward)
        # The same kernel on a dense copy: the same operations, so the same bits.
        want = rope_triton(host.to(KERNEL_DEVICE), cos, sin, backward=backward)
        assert torch.equal(got, want), backward
