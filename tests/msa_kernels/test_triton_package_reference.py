"""Triton backend vs the package's reference backend on a real ``MSAMicrobatch`` layout.

CPU (interpreter) at a small size with padding, plus the production topology at full size on a
GPU (``gpu`` marker; skipped with the reason elsewhere).
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_msa.attention.naive import (
    sparse_attention_backward_reference,
    sparse_attention_forward_reference,
)
from nemo_msa.attention.triton_bwd import triton_attention_backward
from nemo_msa.attention.triton_fwd import triton_attention_forward
from nemo_msa.layout import MSAMicrobatch
from nemo_msa.selection.naive import select_blocks_reference
from nemo_msa.selection.triton_select import triton_select_blocks
from nemo_msa.testing.oracle import rel_err
from nemo_msa.testing.packs import document_map_from_lengths


def _check(rows, seq_len, bs, hq, hkv, d, hi, di, top_k, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = document_map_from_lengths(rows, seq_len, device)
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=bs, init_blocks=0, local_blocks=1)
    t = msa.num_tokens

    def rnd(*shape):
        return torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)

    iq, ik = rnd(t, hi, di), rnd(t, di)
    q, k, v, do = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d), rnd(t, hq, d)
    q2k = triton_select_blocks(iq, ik, msa, top_k=top_k, init_blocks=0, local_blocks=1)
    ref_sel = select_blocks_reference(iq, ik, msa, top_k=top_k, init_blocks=0, local_blocks=1)
    match = (q2k == ref_sel).all(-1).float().mean().item()
    # Random bf16 inputs: exact ties are absent, but fp32 summation order may flip a near-tie
    # between the kernel and the fp32 reference; a handful of rows at most.
    assert match > 0.999 if t > 4000 else match == 1.0, f"selection match {match}"
    scale = 1.0 / math.sqrt(d)
    q2k = q2k[:hkv].contiguous() if hi != hkv else q2k
    out, lse = triton_attention_forward(q, k, v, q2k, msa, scale)
    dq, dk, dv = triton_attention_backward(do, q, k, v, out, lse, q2k, msa, scale)
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    o64, l64 = sparse_attention_forward_reference(q64, k64, v64, q2k, msa, scale)
    g64 = sparse_attention_backward_reference(do64, q64, k64, v64, o64, l64, q2k, msa, scale)
    assert rel_err(out, o64) < 1e-2
    assert rel_err(lse, l64) < 1e-4
    for name, x, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, strict=True):
        err = rel_err(x, ref)
        assert err < 1e-2, f"{name} rel err {err:.2e}"


def test_matches_package_reference_cpu():
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case; the GPU case below covers CUDA machines")
    _check([[1, 20, 16], [23]], 40, 16, 4, 2, 32, 2, 32, 3, "cpu", seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,seq_len", [([[8192]], 8192),
                                          ([[3000, 128, 1, 2000], [4096, 7]], 8192)])
def test_production_topology_gpu(rows, seq_len):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the full-size production topology (64/4 heads, d 128, "
                    "block 128, top-16) is too slow for the CPU interpreter")
    _check(rows, seq_len, 128, 64, 4, 128, 4, 128, 16, "cuda", seed=11)
