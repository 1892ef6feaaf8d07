"""The dense-document path of MSACoreAttention against the core's reference oracle, and the
layer's choice of the fused dense indexer loss."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nemo_msa import MSAMicrobatch
from nemo_msa.attention import dense_document_attention
from nemo_msa.attention.naive import masked_attention_reference as oracle


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
        float((a - b).detach().abs().max())
        for a, b in zip((out, *grads), (ref, *ref_grads), strict=True)
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


def test_the_plan_takes_the_fused_dense_loss_only_where_it_computes_the_same_function(
        monkeypatch):
    """``MSAPlan.fused_dense_loss``: score "max", a backend whose record has the fused loss and
    a shape and dtype the kernel runs; otherwise the chunked reference (a GPU-less double of the
    Triton backend's device check stands in)."""
    import dataclasses

    from nemo_msa.backends import registry as backends
    from nemo_msa.plan import MSAPlan

    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    triton = backends.get_backend("triton")
    monkeypatch.setitem(backends._REGISTRY, "triton",
                        dataclasses.replace(triton, unavailable_reason=lambda device: None))

    def fused(backend="triton", dtype=torch.bfloat16, **changes):
        fields = dict(num_attention_heads=8, num_query_groups=2, kv_channels=16, hidden_size=128,
                      msa_num_index_heads=2, msa_index_head_dim=16, msa_block_size=64,
                      msa_topk=4, msa_init_blocks=0, msa_local_blocks=1, msa_score_type="max")
        fields.update(changes)
        return MSAPlan.build(SimpleNamespace(**fields), "cpu", dtype,
                             backend=backend).fused_dense_loss

    assert fused()
    assert not fused(backend="reference")
    assert not fused(backend="reference", msa_score_type="lse")
    assert not fused(backend="reference", msa_block_size=256)
    assert not fused(backend="reference", dtype=torch.float32)
    assert not fused(num_attention_heads=64)  # 32 query heads per KV head
