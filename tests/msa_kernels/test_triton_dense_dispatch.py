"""The dense dispatch (ADR 0026) on the Triton kernels: the sparse side and the prefixes' block
mass run as query subsets whose kernel views the plan built from host counts (no
synchronization). Dispatched and all-sparse runs agree (outputs, block mass, gradients of q/k/v)
and both are within the contract's bf16 tolerance of the float64 oracle, on packed rows with
documents shorter than the 32-token prefix limit, straddling it and longer, and padding."""

from __future__ import annotations

from unittest import mock

import torch
from _msa_support import KERNEL_DEVICE

from nemo_msa import MSAMicrobatch, ops, select_blocks
from nemo_msa.backends_triton import BACKEND
from nemo_msa.testing.oracle import attention_grads_f64, rel_err
from nemo_msa.testing.packs import document_map_from_lengths

BS, TOP_K = 16, 2  # prefixes of 32 tokens
TOL = 1e-2


def test_triton_dispatch_equals_all_sparse_and_the_oracle():
    ids = document_map_from_lengths([[5, 32, 33, 70], [20, 47]], 150, KERNEL_DEVICE)
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=BS)
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d = msa.num_tokens, 4, 2, 16

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(KERNEL_DEVICE, torch.bfloat16)

    q, k, v, iq, ik = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d), rnd(t, hkv, d), rnd(t, d)
    dout = rnd(t, hq, d)
    q2k = select_blocks(iq, ik, msa, top_k=TOP_K, backend=BACKEND)
    runs = {}
    for name, sel in (("dispatch", q2k), ("sparse", q2k.clone())):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with mock.patch.object(ops, "dispatched_attention",
                               wraps=ops.dispatched_attention) as spy:
            out, mass = ops.document_attention(*leaves, msa, softmax_scale=d**-0.5, q2k=sel,
                                               backend=BACKEND, return_block_mass=True)
        assert spy.call_count == (name == "dispatch")
        out.backward(dout)
        runs[name] = (out.float(), mass, *(x.grad.float() for x in leaves))
    for a, b in zip(runs["dispatch"], runs["sparse"], strict=True):
        assert torch.isfinite(a).all() and rel_err(a, b) < TOL
    host = MSAMicrobatch.build(packed_seq_ids=ids.cpu(), block_size=BS)
    ref_out, _, *ref_grads = attention_grads_f64(
        *(x.cpu() for x in (q, k, v)), q2k.cpu(), host, d**-0.5, BS, dout.cpu())
    assert rel_err(runs["dispatch"][0].cpu(), ref_out) < TOL
    for got, want in zip(runs["dispatch"][2:], ref_grads, strict=True):
        assert rel_err(got.cpu(), want) < TOL
