"""Issue #29: the public ops refuse arguments no backend can run, naming the argument, its value
and what was expected, before anything is dispatched: a string, bool or non-finite
softmax_scale, integer or bool q/k/v (dense and sparse alike), zero-sized head counts or head
dims, tensors on another device than the layout's. Before, these ended in a ZeroDivisionError,
an SDPA RuntimeError or a kernel's own complaint that named nothing.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from nemo_msa import MSAMicrobatch, select_blocks, sparse_attention
from nemo_msa.limits import require_float_tensor, require_softmax_scale
from nemo_msa.ops import document_attention

T, HQ, HKV, D = 64, 4, 2, 16


def _inputs():
    msa = MSAMicrobatch.build(packed_seq_ids=torch.ones(1, T, dtype=torch.int64), block_size=16)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, HQ, D, generator=g)
    k = torch.randn(T, HKV, D, generator=g)
    v = torch.randn(T, HKV, D, generator=g)
    q2k = select_blocks(torch.randn(T, HKV, D, generator=g), torch.randn(T, D, generator=g),
                        msa, top_k=2, backend="reference")
    return msa, {"q": q, "k": k, "v": v}, q2k


def _sparse(msa, qkv, q2k, **kw):
    return sparse_attention(qkv["q"], qkv["k"], qkv["v"], q2k, msa, backend="reference", **kw)


def _dense(msa, qkv, q2k, softmax_scale=0.25):
    return document_attention(qkv["q"], qkv["k"], qkv["v"], msa, softmax_scale=softmax_scale)


OPS = {"sparse": _sparse, "dense": _dense}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("scale, error, message", [
    ("0.125", TypeError, r"softmax_scale='0.125' \(str\); expected a finite positive float"),
    (True, TypeError, r"softmax_scale=True \(bool\); expected a finite positive float"),
    (torch.tensor(0.1), TypeError, r"softmax_scale=tensor\(0.1000\) \(Tensor\); expected"),
    (math.nan, ValueError, r"softmax_scale=nan; expected a finite positive float"),
    (math.inf, ValueError, r"softmax_scale=inf; expected a finite positive float"),
    (-0.25, ValueError, r"softmax_scale=-0.25; expected a finite positive float"),
    (0.0, ValueError, r"softmax_scale=0.0; expected a finite positive float"),
])
def test_bad_softmax_scale_is_named(op, scale, error, message):
    msa, qkv, q2k = _inputs()
    with pytest.raises(error, match=message):
        OPS[op](msa, qkv, q2k, softmax_scale=scale)
    # The same call with a good scale runs, and both ops agree on its meaning.
    assert torch.isfinite(OPS[op](msa, qkv, q2k, softmax_scale=0.25)).all()


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("name, dtype", [("q", torch.int64), ("k", torch.int32),
                                         ("v", torch.bool), ("q", torch.complex64)])
def test_non_float_q_k_v_are_refused_naming_the_tensor(op, name, dtype):
    msa, qkv, q2k = _inputs()
    qkv[name] = qkv[name].to(dtype)
    with pytest.raises(ValueError, match=rf"^{name} has dtype {dtype}; expected a floating-point "
                                         r"tensor \[tokens, heads, dim\] \(bf16, fp16, fp32 or "
                                         r"fp64\)$"):
        OPS[op](msa, qkv, q2k)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("shapes, name", [
    ({"q": (T, HQ, 0), "k": (T, HKV, 0), "v": (T, HKV, 0)}, "q"),   # zero head dim
    ({"k": (T, 0, D), "v": (T, 0, D)}, "k"),                         # zero KV heads
    ({"q": (T, 0, D)}, "q"),                                         # zero query heads
])
def test_zero_sized_heads_or_head_dims_are_refused(op, shapes, name):
    msa, qkv, q2k = _inputs()
    for key, shape in shapes.items():
        qkv[key] = torch.zeros(shape)
    shape = tuple(qkv[name].shape)
    with pytest.raises(ValueError, match=rf"^{name} has shape {re.escape(str(shape))} "
                                         r"\[tokens, heads, dim\]; expected every dimension "
                                         r"after the tokens to be at least 1$"):
        OPS[op](msa, qkv, q2k)


@pytest.mark.parametrize("op", list(OPS))
def test_non_tensors_and_other_devices_are_named(op):
    msa, qkv, q2k = _inputs()
    good = dict(qkv)
    qkv["k"] = qkv["k"].tolist()
    with pytest.raises(TypeError, match=r"^k must be a torch.Tensor \[tokens, heads, dim\]; got "
                                        r"list$"):
        OPS[op](msa, qkv, q2k)
    qkv = dict(good, v=good["v"].to("meta"))
    with pytest.raises(ValueError, match=r"q \(cpu\), k \(cpu\), v \(meta\) and the layout "
                                         r"\(cpu\) must share one device"):
        OPS[op](msa, qkv, q2k)
    qkv = dict(good, k=good["k"].double())
    with pytest.raises(ValueError, match=r"q, k, v dtypes differ: torch.float32, torch.float64"):
        OPS[op](msa, qkv, q2k)


def test_sparse_q2k_must_be_a_tensor():
    msa, qkv, q2k = _inputs()
    with pytest.raises(TypeError, match=r"q2k must be an int32 torch.Tensor \[kv_heads, tokens, "
                                        r"top_k\]; got list"):
        _sparse(msa, qkv, q2k.tolist())


@pytest.mark.parametrize("change, error, message", [
    ({"index_q": torch.ones(T, 2, D, dtype=torch.int64)}, ValueError,
     r"^index_q has dtype torch.int64; expected a floating-point tensor \[tokens, index_heads, "
     r"dim\]"),
    ({"index_k": torch.ones(T, D, dtype=torch.bool)}, ValueError,
     r"^index_k has dtype torch.bool; expected a floating-point tensor \[tokens, dim\]"),
    ({"index_q": torch.ones(T, 0, D)}, ValueError,
     r"^index_q has shape \(64, 0, 16\) \[tokens, index_heads, dim\]; expected every dimension"),
    ({"index_q": torch.ones(T, 2, 0), "index_k": torch.ones(T, 0)}, ValueError,
     r"^index_q has shape \(64, 2, 0\)"),
    ({"index_q": "q"}, TypeError, r"^index_q must be a torch.Tensor \[tokens, index_heads, dim\]"),
])
def test_select_blocks_refuses_non_float_and_zero_sized_index_tensors(change, error, message):
    msa, _, _ = _inputs()
    args = {"index_q": torch.randn(T, 2, D), "index_k": torch.randn(T, D), **change}
    with pytest.raises(error, match=message):
        select_blocks(args["index_q"], args["index_k"], msa, top_k=2, backend="reference")


def test_the_shared_checks_accept_what_the_ops_run():
    for value in (None, 0.125, 1, 2.0):
        require_softmax_scale(value)
    require_float_tensor("q", torch.zeros(3, 1, 1, dtype=torch.bfloat16), "[tokens, heads, dim]")
    # Zero tokens is the layout's business (it has no empty form), not a head dimension's.
    require_float_tensor("q", torch.zeros(0, 1, 1), "[tokens, heads, dim]")


def test_core_attention_checks_its_softmax_scale_at_construction():
    from megatron.core.transformer.enums import AttnMaskType

    from nemo_msa.megatron.core_attention import MSACoreAttention

    class Config:
        attention_dropout = 0.0
        kv_channels = 16

    with pytest.raises(TypeError, match=r"softmax_scale='1/8' \(str\)"):
        MSACoreAttention.__init__(MSACoreAttention.__new__(MSACoreAttention), Config(), 1,
                                  AttnMaskType.causal, "self", softmax_scale="1/8")
