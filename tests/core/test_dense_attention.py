"""Dense document attention: the per-document SDPA path against the masked-row path and float64.

On the CPU the per-document path runs through torch's CPU flash kernel (any float dtype), so its
plan (runs of equal-length documents, [n, H, L, d] views, GQA without copies) is checked here;
the GPU tests check that cuDNN takes the production shape and that bf16 matches float64.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from packs import document_map_from_rows, packed_batches, random_document_map
from torch.nn.attention import SDPBackend

from nemo_msa import MSAMicrobatch
from nemo_msa.attention import (
    dense_document_attention,
    dense_document_attention_per_document,
    dense_document_attention_rows,
)
from nemo_msa.attention import naive as oracle
from nemo_msa.attention.dense import GPU_SDPA_BACKENDS, DocumentRun, document_runs


def _inputs(msa, heads_q, heads_kv, dim, dtype, generator, device="cpu"):
    def rand(heads):
        x = torch.randn(msa.num_tokens, heads, dim, dtype=torch.float64, generator=generator)
        return x.to(device=device, dtype=dtype).requires_grad_()

    q, k, v = rand(heads_q), rand(heads_kv), rand(heads_kv)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=generator).to(device, dtype)
    return q, k, v, dout


def _forward_and_grads(fn, q, k, v, dout, msa, scale):
    out = fn(q, k, v, msa, scale)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _max_errors(results, reference):
    return [float((a - b).detach().abs().max()) for a, b in zip(results, reference, strict=True)]


@settings(max_examples=25, deadline=None)
@given(packed_batches(max_batch=3, max_seq=300))
def test_per_document_path_matches_the_masked_rows_and_float64(case):
    """Random packed layouts: padding between and after documents, length-1 documents,
    documents shorter than a block and exact block multiples; out, dq, dk, dv in float64."""
    ids, block = case
    msa = MSAMicrobatch.from_document_map(ids, block_size=block)
    generator = torch.Generator().manual_seed(int(ids.sum()) % 10_000)
    q, k, v, dout = _inputs(msa, 4, 2, 8, torch.float64, generator)
    per_document = _forward_and_grads(
        dense_document_attention_per_document, q, k, v, dout, msa, 0.37
    )
    rows = _forward_and_grads(dense_document_attention_rows, q, k, v, dout, msa, 0.37)
    reference = _forward_and_grads(
        lambda *a: oracle.masked_attention_reference(*a[:4], softmax_scale=a[4]),
        q, k, v, dout, msa, 0.37,
    )
    assert max(_max_errors(per_document, reference)) < 1e-10, _max_errors(per_document, reference)
    assert max(_max_errors(rows, reference)) < 1e-10, _max_errors(rows, reference)
    assert max(_max_errors(per_document, rows)) < 1e-10


def test_per_document_path_in_fp32_and_bf16_on_the_cpu_stays_close_to_float64():
    ids = random_document_map(torch.Generator().manual_seed(3), batch=2, seq=700, max_doc=400)
    msa = MSAMicrobatch.from_document_map(ids, block_size=128)
    generator = torch.Generator().manual_seed(4)
    q, k, v, dout = _inputs(msa, 8, 2, 32, torch.float64, generator)
    reference = _forward_and_grads(dense_document_attention_rows, q, k, v, dout, msa, 32**-0.5)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        got = _forward_and_grads(
            dense_document_attention_per_document, *xs, dout.to(dtype), msa, 32**-0.5
        )
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, reference, strict=True):
            assert a.dtype == dtype, (name, a.dtype)
            error = float((a.double() - b).detach().norm() / b.detach().norm())
            assert error < tolerance, f"{dtype} {name}: relative error {error:.2e}"


def test_runs_group_consecutive_documents_of_one_length():
    rows = [[(5, 0), (5, 0), (5, 0), (7, 2)], [(5, 0), (5, 3)], [(16, 0)]]
    msa = MSAMicrobatch.from_document_map(document_map_from_rows(rows, 24), block_size=16)
    assert msa.document_lengths == (5, 5, 5, 7, 5, 5, 16)
    assert document_runs(msa) == (
        DocumentRun(start=0, count=3, length=5),
        DocumentRun(start=15, count=1, length=7),
        DocumentRun(start=22, count=2, length=5),
        DocumentRun(start=32, count=1, length=16),
    )
    assert document_runs(msa) is document_runs(msa)  # planned once per layout

    # One document per row, rows of one length: a single batched call, no concatenation.
    msa = MSAMicrobatch.build(batch_size=3, seq_len=40, block_size=16)
    assert document_runs(msa) == (DocumentRun(start=0, count=3, length=40),)


def test_one_batched_call_per_run(monkeypatch):
    """The plan is what runs: one SDPA call per run, on [n, H, L, d] views with GQA."""
    import nemo_msa.attention.dense as dense

    rows = [[(6, 0)] * 4 + [(3, 0)], [(9, 0), (6, 0)]]
    msa = MSAMicrobatch.from_document_map(document_map_from_rows(rows, 27), block_size=16)
    calls = []
    real = dense._causal_gqa_sdpa

    def spy(q, k, v, scale):
        calls.append((tuple(q.shape), tuple(k.shape), q.data_ptr(), k.data_ptr()))
        return real(q, k, v, scale)

    monkeypatch.setattr(dense, "_causal_gqa_sdpa", spy)
    q, k, v, _ = _inputs(msa, 6, 2, 4, torch.float32, torch.Generator().manual_seed(0))
    dense_document_attention_per_document(q, k, v, msa, 0.5, pad_to=None)
    assert [(c[0], c[1]) for c in calls] == [
        ((4, 6, 6, 4), (4, 2, 6, 4)),
        ((1, 6, 3, 4), (1, 2, 3, 4)),
        ((1, 6, 9, 4), (1, 2, 9, 4)),
        ((1, 6, 6, 4), (1, 2, 6, 4)),
    ]
    # Views into the compact tensors (no copies, K/V not repeated per query head). K is a view
    # of its one finite copy (nemo_msa.attention.finite: the NaN/Inf containment, ADR 0025).
    starts = [0, 24, 27, 36]
    element = q.element_size()
    assert [c[2] for c in calls] == [q.data_ptr() + s * 6 * 4 * element for s in starts]
    assert [c[3] - calls[0][3] for c in calls] == [s * 2 * 4 * element for s in starts]


def _graph_nodes(out: torch.Tensor) -> list[str]:
    """Names of the autograd nodes ``out`` reaches."""
    seen, stack, names = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def test_runs_split_the_inputs_once_rather_than_slicing_per_run():
    """Each run's q, k, v come from one split per tensor: a slice's backward would write a
    gradient of the whole tensor per run (a pass over all of q per document in packed rows)."""
    rows = [[(6, 0)] * 4 + [(3, 0)], [(9, 0), (6, 0)]]
    msa = MSAMicrobatch.from_document_map(document_map_from_rows(rows, 27), block_size=16)
    q, k, v, dout = _inputs(msa, 6, 2, 4, torch.float64, torch.Generator().manual_seed(0))
    out = dense_document_attention_per_document(q, k, v, msa, 0.5, pad_to=None)
    names = _graph_nodes(out)
    assert len(document_runs(msa)) == 4
    assert names.count("SplitWithSizesBackward0") == 3, names
    assert "SliceBackward0" not in names, names
    # NaN containment reads and writes each tensor once (no masked_fill copy, no per-head mask).
    assert "MaskedFillBackward0" not in names and "CloneBackward0" not in names, names
    assert names.count("WhereBackward0") == 3, names
    # The same function as the masked rows (the split changes only the plan's graph).
    reference = _forward_and_grads(dense_document_attention_rows, q, k, v, dout, msa, 0.5)
    got = _forward_and_grads(
        lambda *a: dense_document_attention_per_document(*a, pad_to=None), q, k, v, dout, msa,
        0.5,
    )
    assert max(_max_errors(got, reference)) < 1e-12


def test_runs_that_do_not_cover_q_in_order_are_refused():
    from nemo_msa.attention.dense import dense_attention_runs

    q, k, v = (torch.randn(10, h, 4) for h in (2, 1, 1))
    for runs in ((DocumentRun(0, 1, 4),), (DocumentRun(4, 1, 6), DocumentRun(0, 1, 4))):
        with pytest.raises(ValueError, match=r"runs=.*expected runs covering q's rows \[0, 10\)"):
            dense_attention_runs(q, k, v, runs, 0.5)
    out = dense_attention_runs(q, k, v, (DocumentRun(0, 1, 4), DocumentRun(4, 1, 6)), 0.5)
    assert out.shape == q.shape


def test_dense_document_attention_takes_the_masked_rows_on_the_cpu(monkeypatch):
    import nemo_msa.attention.dense as dense

    ids = torch.tensor([[1] * 20 + [2] * 30 + [0] * 14, [3] * 9 + [4] * 55])
    msa = MSAMicrobatch.from_document_map(ids, block_size=16)
    taken = []
    monkeypatch.setattr(
        dense, "dense_document_attention_per_document", lambda *a, **k: taken.append("doc")
    )
    q, k, v, _ = _inputs(msa, 4, 2, 16, torch.bfloat16, torch.Generator().manual_seed(0))
    out = dense_document_attention(q, k, v, msa, 0.25)
    assert taken == [] and out.shape == q.shape and out.dtype == torch.bfloat16
    assert "nemo_msa.attention.dense.document_causal_row_mask" in msa._cache


def test_bad_inputs_name_the_shapes():
    msa = MSAMicrobatch.from_document_map(torch.tensor([[1] * 8 + [2] * 8]), block_size=16)
    q = torch.randn(16, 4, 8)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of KV heads"):
        dense_document_attention_per_document(q, torch.randn(16, 3, 8), torch.randn(16, 3, 8),
                                              msa, 1.0)
    with pytest.raises(ValueError, match=r"q has 12 tokens but the layout has num_tokens=16"):
        dense_document_attention(torch.randn(12, 4, 8), torch.randn(12, 2, 8),
                                 torch.randn(12, 2, 8), msa, 1.0)
    with pytest.raises(ValueError, match=r"k \(16, 2, 8\) and v \(16, 2, 4\)"):
        dense_document_attention_rows(q, torch.randn(16, 2, 8), torch.randn(16, 2, 4), msa, 1.0)
    # A layout built by hand without host lengths cannot be planned.
    import dataclasses

    bare = dataclasses.replace(msa, document_lengths=(), _cache={})
    with pytest.raises(ValueError, match=r"msa.document_lengths holds 0 lengths"):
        dense_document_attention_per_document(q, torch.randn(16, 2, 8), torch.randn(16, 2, 8),
                                              bare, 1.0)


# ----------------------------------------------------------------------------------------- GPU


def _check_against_float64(msa, backends, heads_q=64, heads_kv=4, dim=128, seed=6):
    """bf16 on CUDA through ``backends`` vs the same plan in float64 through the math kernel
    (the CPU tests pin the plan to the masked rows; a [b, 64, s, s] float64 score tensor would
    need tens of GB): out, dq, dk, dv within 1e-2 relative error."""
    q, k, v, dout = _inputs(msa, heads_q, heads_kv, dim, torch.bfloat16,
                            torch.Generator().manual_seed(seed), device="cuda")
    scale = 1 / math.sqrt(dim)
    got = _forward_and_grads(
        lambda *a: dense_document_attention_per_document(*a, backends=backends),
        q, k, v, dout, msa, scale,
    )
    xs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    reference = _forward_and_grads(
        lambda *a: dense_document_attention_per_document(*a, backends=(SDPBackend.MATH,)),
        *xs, dout.double(), msa, scale,
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, reference, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape, (name, a.dtype, a.shape)
        error = float((a.double() - b).detach().norm() / b.detach().norm())
        assert error < 1e-2, f"{name}: relative error {error:.2e} vs float64"
    return q, k, v, got


@pytest.mark.gpu
def test_cudnn_alone_takes_the_production_shape():
    """64/4 heads d128 bf16, one 4096-token document in one row and two (1000 + 3096) in the
    other: only cuDNN is allowed, so a refusal fails here instead of falling back silently."""
    ids = torch.tensor([[1] * 4096, [1] * 1000 + [2] * 3096])
    msa = MSAMicrobatch.build(packed_seq_ids=ids.cuda(), block_size=128)
    assert document_runs(msa) == (DocumentRun(0, 1, 4096), DocumentRun(4096, 1, 1000),
                                  DocumentRun(5096, 1, 3096))
    q, k, v, got = _check_against_float64(msa, (SDPBackend.CUDNN_ATTENTION,))
    # The dispatcher takes this path (cuDNN first) on CUDA bf16.
    assert torch.equal(dense_document_attention(q, k, v, msa, 1 / math.sqrt(128)), got[0])


@pytest.mark.gpu
def test_gpu_path_matches_float64_on_a_packed_batch_with_short_documents():
    """Random documents of 1..3000 tokens with padding, a length-1 document first; the default
    backends (cuDNN, then flash, then memory-efficient, whichever takes each run)."""
    ids = random_document_map(torch.Generator().manual_seed(5), batch=2, seq=4096, max_doc=3000)
    ids[0, :1] = 99
    msa = MSAMicrobatch.build(packed_seq_ids=ids.cuda(), block_size=128)
    assert msa.document_lengths[0] == 1
    _check_against_float64(msa, GPU_SDPA_BACKENDS)


@pytest.mark.gpu
def test_gpu_path_adds_no_synchronization_and_no_square_mask():
    ids = random_document_map(torch.Generator().manual_seed(7), batch=2, seq=2048, max_doc=900)
    msa = MSAMicrobatch.build(packed_seq_ids=ids.cuda(), block_size=128)
    q, k, v, dout = _inputs(msa, 16, 4, 128, torch.bfloat16, torch.Generator().manual_seed(8),
                            device="cuda")
    out = dense_document_attention(q, k, v, msa, 0.1)  # compiles / plans once
    torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = dense_document_attention(q, k, v, msa, 0.1)
            torch.autograd.grad(out, (q, k, v), dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert syncs == []
    assert not any("row_mask" in key for key in msa._cache), list(msa._cache)


def test_padded_lengths_are_few_per_octave_and_bounded():
    from nemo_msa.attention.dense import padded_length

    assert [padded_length(n) for n in (1, 64, 65, 1000, 1024, 1025, 4096, 32768, 131072)] == [
        64, 64, 128, 1024, 1024, 1152, 4096, 32768, 131072]
    for octave in range(6, 18):
        lengths = range(1 << octave, 1 << (octave + 1))
        padded = {padded_length(n) for n in lengths}
        assert len(padded - {1 << (octave + 1)}) <= 8, (octave, sorted(padded))
        assert all(n <= padded_length(n) <= n * 9 / 8 + 64 for n in lengths[::97])


def test_padded_runs_match_the_unpadded_ones_and_pad_each_document(monkeypatch):
    """Documents padded to a few lengths (new shapes plan once): same outputs and gradients as
    unpadded views; each document of a run gets its own zero tail."""
    import nemo_msa.attention.dense as dense

    rows = [[(6, 0)] * 4 + [(3, 0)], [(9, 0), (6, 0)]]
    msa = MSAMicrobatch.from_document_map(document_map_from_rows(rows, 27), block_size=16)
    shapes = []
    real = dense._causal_gqa_sdpa
    monkeypatch.setattr(dense, "_causal_gqa_sdpa",
                        lambda q, k, v, scale: shapes.append(tuple(q.shape)) or real(q, k, v,
                                                                                       scale))
    q, k, v, dout = _inputs(msa, 6, 2, 4, torch.float64, torch.Generator().manual_seed(3))
    grads = []
    for pad_to in (None, lambda n: 2 * n + 1):
        qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        out = dense_document_attention_per_document(qq, kk, vv, msa, 0.5, pad_to=pad_to)
        out.backward(dout)
        grads.append((out.detach(), qq.grad, kk.grad, vv.grad))
    assert shapes[4:] == [(4, 6, 13, 4), (1, 6, 7, 4), (1, 6, 19, 4), (1, 6, 13, 4)]
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
