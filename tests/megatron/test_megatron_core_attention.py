"""The dense-document path of MSACoreAttention against the core's reference oracle, and the
layer's choice of the fused dense indexer loss."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nemo_msa import MSAMicrobatch
from nemo_msa.attention import dense_document_attention
from nemo_msa.attention.naive import dense_document_attention as oracle
from nemo_msa.megatron import msa_attention


def test_dense_document_attention_matches_the_oracle_with_gqa_and_padding():
    generator = torch.Generator().manual_seed(1)
    ids = torch.tensor([[1] * 20 + [2] * 30 + [0] * 14, [3] * 9 + [4] * 55])
    msa = MSAMicrobatch.from_document_map(ids, block_size=16)
    tokens = msa.num_tokens

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).requires_grad_()

    q, k, v = rand(tokens, 4, 16), rand(tokens, 2, 16), rand(tokens, 2, 16)
    out = dense_document_attention(q, k, v, msa, 0.3)
    ref = oracle(q, k, v, msa, softmax_scale=0.3)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=generator)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    errors = [
        float((a - b).abs().max()) for a, b in zip((out, *grads), (ref, *ref_grads), strict=True)
    ]
    assert max(errors) < 1e-10, f"max |diff| of out, dq, dk, dv vs the oracle: {errors}"


def test_sbhd_pack_and_unpack_match_the_layout_on_transposed_tensors():
    from nemo_msa.megatron.microbatch import pack_sbhd, unpack_sbhd

    ids = torch.tensor([[1] * 5 + [2] * 6 + [0] * 5, [3] * 16, [0] * 4 + [4] * 12])
    msa = MSAMicrobatch.from_document_map(ids, block_size=16)
    x = torch.randn(16, 3, 2, 4)  # [s, b, heads, dim]
    packed = pack_sbhd(msa, x)
    assert torch.equal(packed, msa.pack(x.transpose(0, 1)))
    back = unpack_sbhd(msa, packed)
    assert torch.equal(back, msa.unpack(packed).transpose(0, 1))
    assert torch.equal(back[ids.T == 0], torch.zeros_like(back[ids.T == 0]))


def test_layer_takes_the_fused_dense_loss_only_where_it_computes_the_same_function(monkeypatch):
    """``MSASelfAttention.fused_dense_loss``: score "max", a Triton-based backend and a shape the
    kernel runs; otherwise the chunked reference (a GPU-less double stands in for the backend)."""
    backend = {"name": "triton"}
    monkeypatch.setattr(msa_attention, "resolve_backend",
                        lambda name, device: SimpleNamespace(name=backend["name"]))
    bf = torch.bfloat16
    q, k, iq = torch.zeros(8, 8, 16, dtype=bf), torch.zeros(8, 2, 16, dtype=bf), torch.zeros(
        8, 2, 16, dtype=bf)

    def fused(score="max", block=64, query=q, index_q=iq, cp_size=1):
        layer = SimpleNamespace(cp_size=cp_size, msa_backend="auto", config=SimpleNamespace(
            msa_score_type=score, msa_backend="auto", msa_block_size=block))
        return msa_attention.MSASelfAttention.fused_dense_loss(layer, query, k, index_q)

    assert fused()
    assert not fused(cp_size=2)  # the fused kernel has no query-subset mode (yet)
    assert not fused(score="lse")
    assert not fused(block=256)
    assert not fused(query=q.float(), index_q=iq.float())
    backend["name"] = "reference"
    assert not fused()
