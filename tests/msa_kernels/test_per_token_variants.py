"""benchmarks/per_token_variants.py's kernels (ADR 0035): the key-split per-token forward and dq
against float64 attention on the same selection, and the gather kernel's fold against the
blocks it reads. Under the interpreter the split kernels take fp32 operands (its bf16 dot is
not the GPU's), compiled on a GPU the production bf16 ones; the timing itself needs the GPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import per_token_variants as ptv  # noqa: E402
from _msa_support import KERNEL_DEVICE, on_kernel_device  # noqa: E402
from msa_bench.cases import make_case  # noqa: E402

from nemo_msa.testing.oracle import attention_rows_f64, rel_err  # noqa: E402

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

T, G, D, BS, TOPK = 384, 16, 128, 128, 16
#: fp32 operands and their tolerance under the interpreter; bf16 ones compiled on a GPU.
FP32_DOT = KERNEL_DEVICE == "cpu"
TOL = 1e-5 if FP32_DOT else 1e-2
#: The tokens the kernels run (pid 0 is token T0): the first block's end, the second block's
#: start, and the third block's first rows, where a selection reaches back two blocks.
T0, N = 254, 6


def _inputs(seed: int):
    """One document of T tokens, one KV head of G query heads, bf16 values, and a selection
    of the own block plus a random earlier block (or none), padded with -1 in random slots."""
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(T, G, D, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(T, 1, D, generator=gen).bfloat16() for _ in range(2))
    q2k = torch.full((1, T, TOPK), -1, dtype=torch.int32)
    for t in range(T):
        own = t // BS
        slots = torch.randperm(TOPK, generator=gen)[:2]
        q2k[0, t, slots[0]] = own
        if own > 0:
            q2k[0, t, slots[1]] = int(torch.randint(0, own, (1,), generator=gen))
    return q, k, v, do, q2k


@pytest.mark.parametrize("ws", [2, 4])
def test_split_forward_and_dq_equal_float64_attention(ws):
    q, k, v, do, q2k = _inputs(ws)
    msa = make_case("doc", [[T]], T, "cpu")["msa"]
    rows = torch.arange(T0, T0 + N)
    scale = 1.0 / math.sqrt(D)
    out_ref, lse_ref, dq_ref = attention_rows_f64(q, k, v, do, q2k, msa, rows, scale, BS)
    # The block mass: each slot's softmax probability summed, the group's heads averaged.
    mass_ref = torch.zeros(N, TOPK, dtype=torch.float64)
    for i, t in enumerate(rows.tolist()):
        for s, b in enumerate(q2k[0, t].tolist()):
            if b >= 0:
                keys = k[b * BS:min((b + 1) * BS, t + 1), 0].double()
                sc = q[t].double() @ keys.T * scale
                mass_ref[i, s] = torch.exp(sc - lse_ref[:, i, None]).sum(-1).mean()
    ops = on_kernel_device(*((x.float() if FP32_DOT else x) for x in (q, k, v, do)), q2k)
    qk, kk, vk, dok, q2kk = ops
    out, lse = torch.zeros_like(qk), torch.zeros(G, T, device=KERNEL_DEVICE)
    mass = torch.zeros(1, T, TOPK, device=KERNEL_DEVICE)
    ptv._fwd_split_kernel[(N, 1)](
        qk, kk, vk, q2kk, out, lse, mass, qk.stride(0), qk.stride(1), kk.stride(0), kk.stride(1),
        q2kk.stride(0), q2kk.stride(1), lse.stride(0), mass.stride(0), mass.stride(1),
        scale * ptv.LOG2E, T0, TOPK=TOPK, G=G, BS=BS, D=D, WS=ws, KP=TOPK, FP32_DOT=FP32_DOT)
    out, lse, mass = out.cpu(), lse.cpu(), mass.cpu()
    assert rel_err(out[rows], out_ref) < TOL
    assert rel_err(lse[:, rows], lse_ref) < TOL
    assert rel_err(mass[0, rows], mass_ref) < TOL
    lse_nat = torch.zeros(G, T)
    lse_nat[:, rows] = lse_ref.float()
    delta = torch.zeros(G, T)
    delta[:, rows] = (do[rows].double() * out_ref).sum(-1).T.float()
    lse_nat, delta = on_kernel_device(lse_nat, delta)
    dq = torch.zeros_like(qk)
    ptv._dq_split_kernel[(N, 1)](
        qk, kk, vk, dok, lse_nat, delta, dq, q2kk, qk.stride(0), qk.stride(1), kk.stride(0),
        kk.stride(1), q2kk.stride(0), q2kk.stride(1), lse_nat.stride(0), scale,
        scale * ptv.LOG2E, T0, TOPK=TOPK, G=G, BS=BS, D=D, WS=ws, FP32_DOT=FP32_DOT)
    dq = dq.cpu()
    assert rel_err(dq[rows], dq_ref) < TOL
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()


def test_gather_kernel_folds_every_selected_block():
    _, k, v, _, _ = _inputs(0)
    rows = 4
    gen = torch.Generator().manual_seed(1)
    # Each row's 16 slots: blocks 0..2 and -1 (block 0 again) in random counts, so that the
    # xor of a row keeps the blocks read an odd number of times.
    q2k = torch.randint(-1, T // BS, (1, rows, TOPK), generator=gen, dtype=torch.int32)
    kd, vd, q2kd = on_kernel_device(k, v, q2k)
    folded = torch.zeros((rows, 1), dtype=torch.int16, device=KERNEL_DEVICE)
    ptv._gather_kernel[(rows, 1)](kd, vd, q2kd, folded, kd.stride(0), kd.stride(1),
                                  q2kd.stride(0), q2kd.stride(1), TOPK=TOPK, BS=BS, D=D)
    folded = folded.cpu()
    bits = (k[:, 0].view(torch.int16) ^ v[:, 0].view(torch.int16)).numpy()
    wants = []
    for t in range(rows):
        want = 0
        for b in q2k[0, t].clamp_min(0).tolist():  # a -1 slot reads block 0, as the kernel does
            want ^= int(np.bitwise_xor.reduce(bits[b * BS:(b + 1) * BS].ravel()))
        wants.append(want)
    assert folded[:, 0].tolist() == wants
    assert any(wants), "every row's blocks cancel: the check would pass an empty kernel"
