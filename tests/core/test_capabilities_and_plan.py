"""The backends' capability records and the per-layer plan (ADR 0019)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_support_and_backends import production_config

from nemo_msa import MSAMicrobatch, ops, select_blocks, sparse_attention
from nemo_msa.backends.capabilities import FLASHINFER_PREFILL, REFERENCE, TRITON
from nemo_msa.plan import MSAPlan
from nemo_msa.triton.kernel_layout import kernel_layout


def config(**changes):
    return production_config(**{"msa_backend": None, "msa_indexer_loss_type": "sparse",
                                **changes})


@pytest.mark.parametrize(("record", "shape", "field"), [
    (REFERENCE, dict(top_k=33), "msa_topk=33"),
    (REFERENCE, dict(block_size=512), "msa_block_size=512"),
    (REFERENCE, dict(score_type="mean"), "msa_score_type='mean'"),
    (REFERENCE, dict(dtype=torch.int32), "params dtype torch.int32"),
    (TRITON, dict(score_type="lse"), "msa_score_type='lse'"),
    (TRITON, dict(head_dim=256), "kv_channels=256"),
    (TRITON, dict(index_head_dim=8), "msa_index_head_dim=8"),
    (TRITON, dict(dtype=torch.float64), "params dtype torch.float64"),
    (FLASHINFER_PREFILL, dict(top_k=17), "msa_topk=17"),
    (FLASHINFER_PREFILL, dict(group=32), "= 32 query heads per KV head"),
])
def test_each_record_names_the_field_it_cannot_run(record, shape, field):
    assert field in record.why_not(**shape)


def test_the_records_accept_what_their_backend_runs():
    production = dict(head_dim=128, index_head_dim=128, block_size=128, top_k=16,
                      score_type="max", dtype=torch.bfloat16, group=16)
    for record in (REFERENCE, TRITON, FLASHINFER_PREFILL):
        shape = dict(production)
        if record is FLASHINFER_PREFILL:
            del shape["index_head_dim"], shape["score_type"]  # the forward only
        assert record.why_not(**shape) is None, record.name
    for dtype in (torch.float32, torch.float64):
        assert REFERENCE.why_not(dtype=dtype, head_dim=8) is None


@pytest.mark.parametrize("backend", ["reference", "triton", "flashinfer"])
def test_the_plan_refuses_a_shape_the_backend_cannot_run(kernel_backends_on_the_cpu, backend):
    """Refused when the plan is built, by the backend's record, naming the field."""
    bad = {"reference": (dict(msa_topk=33), torch.bfloat16, "msa_topk=33"),
           "triton": (dict(msa_score_type="lse"), torch.bfloat16, "msa_score_type='lse'"),
           "flashinfer": (dict(), torch.float32, "params dtype torch.float32")}
    changes, dtype, field = bad[backend]
    with pytest.raises(ValueError, match=field):
        MSAPlan.build(config(**changes), "cpu", dtype, backend=backend)
    plan = MSAPlan.build(config(), "cpu", torch.bfloat16, backend=backend)
    assert plan.backend.name == backend and plan.backend.capabilities.why_not(
        top_k=16, dtype=torch.bfloat16) is None


def test_the_plan_decides_the_indexer_loss_path(kernel_backends_on_the_cpu):
    triton = MSAPlan.build(config(), "cpu", torch.bfloat16, backend="triton")
    assert triton.loss_from_byproducts and triton.fused_dense_loss
    assert triton.dense_loss_reason is None
    reference = MSAPlan.build(config(), "cpu", torch.bfloat16, backend="reference")
    assert reference.loss_from_byproducts and not reference.fused_dense_loss
    assert "no fused dense indexer loss" in reference.dense_loss_reason
    lse = MSAPlan.build(config(msa_score_type="lse"), "cpu", torch.float32)
    assert lse.backend.name == "reference"
    assert not lse.loss_from_byproducts and not lse.fused_dense_loss
    dense = MSAPlan.build(config(msa_indexer_loss_type="dense"), "cpu", torch.bfloat16,
                          backend="triton")
    assert not dense.loss_from_byproducts and dense.fused_dense_loss


def test_the_plan_says_which_forward_kernel_a_training_step_runs(kernel_backends_on_the_cpu):
    """flashinfer's prefill serves training only where it takes every call of a step: the
    sparse indexer loss asks for the block mass every step, and context parallelism for a query
    subset, which only the Triton forward gives; other shapes run the Triton forward too."""
    def forward(backend, dtype=torch.bfloat16, cp_size=1, **changes):
        return MSAPlan.build(config(**changes), "cpu", dtype, backend=backend,
                             cp_size=cp_size).training_forward

    assert forward("flashinfer") == TRITON.name  # the production recipe: the sparse loss
    assert forward("flashinfer", msa_indexer_loss_type="dense") == FLASHINFER_PREFILL.name
    assert forward("flashinfer", msa_indexer_loss_coeff=0.0) == FLASHINFER_PREFILL.name
    assert forward("flashinfer", msa_indexer_loss_type="dense", cp_size=2) == TRITON.name
    assert forward("flashinfer", msa_indexer_loss_type="dense", msa_topk=24) == TRITON.name
    assert forward("triton") == TRITON.name
    assert forward("reference", dtype=torch.float32) == REFERENCE.name


@pytest.mark.parametrize(("backend", "fused"),
                         [("reference", False), ("triton", True), ("flashinfer", True)])
def test_the_plan_decides_whether_the_helpers_run_fused(kernel_backends_on_the_cpu, backend,
                                                       fused):
    """The backend's record decides once for the layer's norms, RoPE, loss passes, recall and
    dense path: the reference backend runs their torch references wherever it runs."""
    plan = MSAPlan.build(config(), "cpu", torch.bfloat16, backend=backend)
    assert plan.fused_helpers is fused is plan.backend.capabilities.fused_helpers
    assert plan.sparse_loss  # msa_indexer_loss_type="sparse", held by the plan for the forward
    assert not MSAPlan.build(config(msa_indexer_loss_type="dense"), "cpu", torch.bfloat16,
                             backend=backend).sparse_loss


def test_the_plan_carries_the_larger_of_the_config_and_group_cp_sizes():
    """The one check of context parallelism is the backend record's (see
    test_support_and_backends.py); on the CPU the reference takes every query subset."""
    assert MSAPlan.build(config(), "cpu", torch.bfloat16, cp_size=1).cp_size == 1
    assert MSAPlan.build(config(), "cpu", torch.bfloat16, cp_size=2).cp_size == 2
    assert MSAPlan.build(config(context_parallel_size=4), "cpu", torch.bfloat16).cp_size == 4


def test_ops_take_a_resolved_backend_without_a_lookup(monkeypatch):
    calls = []
    resolve = ops.resolve_backend
    monkeypatch.setattr(ops, "resolve_backend", lambda *a, **k: calls.append(a) or resolve(*a, **k))
    backend = MSAPlan.build(config(), "cpu", torch.float32, backend="reference").backend
    g = torch.Generator().manual_seed(0)
    msa = MSAMicrobatch.build(batch_size=1, seq_len=40, block_size=16)
    q2k = select_blocks(torch.randn(40, 1, 8, generator=g), torch.randn(40, 8, generator=g),
                        msa, top_k=2, backend=backend)
    q, k, v = (torch.randn(40, h, 8, generator=g) for h in (2, 1, 1))
    out = sparse_attention(q, k, v, q2k, msa, backend=backend)
    assert calls == [] and out.dtype == torch.float32
    sparse_attention(q, k, v, q2k, msa, backend="reference")
    assert len(calls) == 1  # a name is resolved for its call


def test_a_kernel_backend_refuses_fp32_where_the_reference_runs_it(kernel_backends_on_the_cpu):
    """The dtypes are the record's: fp32 runs on the reference and is refused by Triton, naming
    it, before anything launches (two backends never compute different functions)."""
    msa = MSAMicrobatch.build(batch_size=1, seq_len=32, block_size=16)
    q, k, v = torch.zeros(32, 2, 16), torch.zeros(32, 1, 16), torch.zeros(32, 1, 16)
    q2k = torch.zeros(1, 32, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="triton backend cannot run params dtype torch.float32"):
        sparse_attention(q, k, v, q2k, msa, backend="triton")
    assert sparse_attention(q, k, v, q2k, msa, backend="reference").shape == q.shape


def test_the_kernels_layout_view_takes_a_layout_only():
    msa = MSAMicrobatch.build(batch_size=1, seq_len=32, block_size=16)
    assert kernel_layout(msa, 16) is kernel_layout(msa.kernel_layout(16), 16)
    with pytest.raises(TypeError, match="MSAMicrobatch or a KernelLayout; got SimpleNamespace"):
        kernel_layout(SimpleNamespace(cu_seqlens=msa.cu_seqlens, num_tokens=32), 16)
