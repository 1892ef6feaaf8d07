"""The backends' capability records and the per-layer plan (ADR 0019)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_support_and_backends import production_config

from nemo_msa import MSAMicrobatch, ops, select_blocks, sparse_attention, unplanned
from nemo_msa.attention.dense import dense_document_attention
from nemo_msa.backends.capabilities import FLASHINFER_PREFILL, GLUON_DKDV, REFERENCE, TRITON
from nemo_msa.indexer_loss import sampled_selection_recall
from nemo_msa.plan import MSAKernels, MSAPlan, choose_kernels
from nemo_msa.support import MSATopology
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
    def plan(backend, dtype=torch.bfloat16, cp_size=1, **changes):
        return MSAPlan.build(config(**changes), "cpu", dtype, backend=backend, cp_size=cp_size)

    def forward(*args, **kwargs):
        return plan(*args, **kwargs).training_forward

    assert forward("flashinfer") == "triton"  # the production recipe: the sparse loss
    sparse = plan("flashinfer").kernels  # evaluation (no block mass) still takes the prefill
    assert (sparse.forward, sparse.mass_forward) == ("flashinfer", "triton")
    assert forward("flashinfer", msa_indexer_loss_type="dense") == "flashinfer"
    assert forward("flashinfer", msa_indexer_loss_coeff=0.0) == "flashinfer"
    assert forward("flashinfer", msa_indexer_loss_type="dense", cp_size=2) == "triton"
    assert forward("flashinfer", msa_indexer_loss_type="dense", msa_topk=24) == "triton"
    assert forward("triton") == "triton"
    assert forward("reference", dtype=torch.float32) == "reference"


def test_the_plan_names_each_helpers_kernel(kernel_backends_on_the_cpu):
    """The backend's record states its helper kernels; the plan asks each for the layer's
    dtype, dims and context parallelism, once. The reference backend runs their torch
    references wherever it runs; under the interpreter the Triton helpers run on the CPU (the
    per-document SDPA is cuDNN's: CUDA only)."""
    reference = MSAPlan.build(config(), "cpu", torch.bfloat16, backend="reference").kernels
    assert reference == MSAKernels(forward="reference", mass_forward="reference",
                                   dkdv="reference")
    for backend in ("triton", "flashinfer"):
        kernels = MSAPlan.build(config(), "cpu", torch.bfloat16, backend=backend).kernels
        assert (kernels.rms_norm, kernels.rope, kernels.loss_passes, kernels.recall) == (
            True, True, True, True), backend
        assert kernels.dense_attention == "rows" and kernels.dkdv == "triton"
    fp16 = MSAPlan.build(config(), "cpu", torch.float16, backend="triton").kernels
    assert fp16.rms_norm and not fp16.rope  # the one-kernel RoPE is bf16's only
    cp = MSAPlan.build(config(), "cpu", torch.bfloat16, backend="triton", cp_size=2).kernels
    assert not cp.recall and cp.dense_attention == "queries"  # no query subset in the recall
    # apply_rope_fusion: the plan names TE's fused RoPE (the layer's gate checks TE and CUDA).
    assert not kernels.te_rope
    te = MSAPlan.build(config(apply_rope_fusion=True), "cpu", torch.bfloat16, backend="triton")
    assert te.kernels.te_rope and te.kernels.rope
    plan = MSAPlan.build(config(), "cpu", torch.bfloat16, backend="triton")
    assert plan.sparse_loss and plan.loss_route == "byproducts"
    assert plan.warmup_loss_route == "fused_dense"
    dense = MSAPlan.build(config(msa_indexer_loss_type="dense"), "cpu", torch.bfloat16,
                          backend="reference")
    assert not dense.sparse_loss and dense.loss_route == dense.warmup_loss_route == (
        "reference_dense")


def test_the_plan_passes_the_compute_capability_it_is_given(kernel_backends_on_the_cpu):
    """The plan's one device query can be replaced: built for an SM90 GPU on the CPU, a
    production-shaped bf16 Triton layer names the Gluon dk/dv kernel."""
    plan = MSAPlan.build(config(), "cpu", torch.bfloat16, backend="triton",
                         compute_capability=(9, 0))
    assert plan.kernels.dkdv == "gluon"


_PRODUCTION = MSATopology()  # 64 heads, 4 KV heads, head and index dims 128, blocks of 128


def _kernels(caps=TRITON, preferred=None, topology=_PRODUCTION, **changes):
    args = dict(dtype=torch.bfloat16, cp_size=1, cuda=True, interpreter=False,
                compute_capability=(9, 0), dkdv_requested="gluon", triton_version="3.6.0")
    return choose_kernels(caps, preferred, topology, **{**args, **changes})


def test_the_gluon_dkdv_choice_is_a_function_of_the_plans_inputs():
    """What an H100 runs, decided on the CPU: the Gluon dk/dv kernel where its record takes
    the device, dtype and shape (and the launch setting asks for it), the Triton one
    otherwise."""
    assert _kernels().dkdv == "gluon"
    for changes in (dict(compute_capability=(10, 0)), dict(compute_capability=None),
                    dict(dtype=torch.float16), dict(dkdv_requested="triton"),
                    dict(triton_version="3.7.0"),
                    dict(topology=MSATopology(num_heads=32, num_kv_heads=4, num_index_heads=4)),
                    dict(topology=MSATopology(block_size=64))):
        assert _kernels(**changes).dkdv == "triton", changes
    assert _kernels(caps=REFERENCE).dkdv == "reference"
    assert "compute capability (8, 0)" in GLUON_DKDV.why_not(
        compute_capability=(8, 0), dtype=torch.bfloat16, head_dim=128, block_size=128,
        group=16, triton_version="3.6.0")


def test_the_flashinfer_forward_choice_is_a_function_of_the_plans_inputs():
    """What a B200 runs, decided on the CPU: the prefill kernel where it takes the shape and
    every token is a query; never with the block mass (it gives none)."""
    chosen = _kernels(preferred=FLASHINFER_PREFILL, compute_capability=(10, 0))
    assert (chosen.forward, chosen.mass_forward, chosen.dkdv) == ("flashinfer", "triton",
                                                                  "triton")
    for changes in (dict(cp_size=2), dict(topology=MSATopology(top_k=24)),
                    dict(topology=MSATopology(num_heads=128)), dict(dtype=torch.float32)):
        assert _kernels(preferred=FLASHINFER_PREFILL, **changes).forward == "triton", changes


def test_the_dense_path_choice_is_a_function_of_the_plans_inputs():
    assert _kernels().dense_attention == "per_document"  # CUDA, bf16: cuDNN per document
    assert _kernels(cp_size=2).dense_attention == "queries"
    assert _kernels(cuda=False, interpreter=True).dense_attention == "rows"
    assert _kernels(caps=REFERENCE).dense_attention == "rows"


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


def test_a_choice_made_without_a_plan_is_counted_and_a_plans_kernel_is_not_replaced():
    """The helpers' decision points: None (a direct caller) chooses per call and counts in
    nemo_msa.unplanned; a kernel a plan named meets an input it does not take with an error
    naming the field, not with the torch path in its place."""
    msa = MSAMicrobatch.build(batch_size=1, seq_len=32, block_size=16)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(32, h, 16, generator=g) for h in (2, 1, 1))
    unplanned.reset()
    dense_document_attention(q, k, v, msa, 0.25)
    q2k = torch.zeros(1, 32, 1, dtype=torch.int32)
    sampled_selection_recall(q, k, q2k, msa, softmax_scale=0.25, num_rows=4)
    assert unplanned.counts() == {"dense_attention": 1, "recall": 1}
    with pytest.raises(ValueError, match=r"MSAKernels.dense_attention='per_document'"):
        dense_document_attention(q, k, v, msa, 0.25, path="per_document")  # fp32 on the CPU
    with pytest.raises(ValueError, match=r"MSAKernels.recall=True but .*dtype torch.float32"):
        sampled_selection_recall(q, k, q2k, msa, softmax_scale=0.25, num_rows=4, fused=True)
    dense_document_attention(q, k, v, msa, 0.25, path="rows")  # what a plan names: not counted
    assert unplanned.counts() == {"dense_attention": 1, "recall": 1}
