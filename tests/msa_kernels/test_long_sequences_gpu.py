"""MSA past 2^31 elements on one GPU: q [T, 64, 128] at T = 264192 (issue 63, ADR 0051).

One MiniMax-M3-shaped attention (64 query and 4 KV heads of 128, 4 index heads of 128, blocks
of 128, top-16, the recipe's forced own block), bf16, run through the public ops with the
Triton backend: the selection, and the forward and backward of ``sparse_attention``. q, O, dO
and dq hold 2^31 + 2^24 elements: rows 262144.. start past 2^31. Sampled query rows (on both
sides of that row, the last ones, the ends of a document) are compared with the float64
references of :mod:`nemo_msa.testing.oracle` computed from the same q2k: the selection (up to
near ties), out, lse and dq, each row on its own; and dk / dv of sampled key blocks (the last
one, the one holding row 262144, a document's partial last block, one in the middle), from
every query that selected them. Two launches: the defaults (per-token kernels for the random
selections of an untrained indexer, the Gluon dk/dv on SM90), and every tile on the union
kernels with the Triton dk/dv.

The query-subset mode (context parallelism) runs the same checks on rank 0 of CP = 2 over a
528384-token row: a local shard of 264192 queries (load-balanced chunks 0 and 3), so its q,
O, dO and dq pass 2^31 elements too.

Each test holds about 30 GB of GPU memory (q, O, dO and dq: 4.3 GB each) and skips, with the
reason, on a GPU with less free.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from nemo_msa import MSAMicrobatch, select_blocks, sparse_attention
from nemo_msa.context_parallel import load_balanced_indices
from nemo_msa.testing.oracle import attention_rows_f64, rel_err, select_rows_f64
from nemo_msa.triton.launch import launch_overrides

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

HQ, HKV, D, HI, DI, BS, TOPK = 64, 4, 128, 4, 128, 128, 16
#: Tokens of the one-GPU test: q holds HQ * D * TOKENS = 2^31 + 2^24 elements.
TOKENS = 262144 + 2048
#: Its documents: the first ends 116 tokens into its last block, the second holds rows 262144..
DOCS = (131572, TOKENS - 131572)
#: The query-subset test: one row of 2 * TOKENS tokens, CP rank 0 of 2 (TOKENS local queries).
CP_DOCS = (300000, 2 * TOKENS - 300000)
TOL = 1e-2  # bf16 operands against float64 (MSA_SPEC.md)
#: The launches: the defaults, and every tile on the union kernels (a tile's union holds at
#: most 8 tokens x 16 blocks) with the Triton dk/dv.
SCHEDULES = {"defaults": {},
             "union": {"fwd.union_max": 128, "bwd.dq_union_max": 128,
                       "bwd.kv_kernel": "triton"}}
NEEDS_GIB = 36
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _room_on_the_gpu():
    free, _ = torch.cuda.mem_get_info()
    if free < NEEDS_GIB * 2**30:
        pytest.skip(f"needs {NEEDS_GIB} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _layout(docs) -> MSAMicrobatch:
    ids = torch.cat([torch.full((n,), i + 1, dtype=torch.int64) for i, n in enumerate(docs)])
    return MSAMicrobatch.build(packed_seq_ids=ids.view(1, -1).to(DEVICE), block_size=BS)


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.bfloat16)


def _block_rows(msa, doc: int, block: int) -> torch.Tensor:
    """int64: the global compact rows of document-local block ``block`` of document ``doc``."""
    start, end = (int(x) for x in msa.cu_seqlens[doc:doc + 2])
    return torch.arange(start + block * BS, min(start + block * BS + BS, end), device=DEVICE)


def _selecting(msa, q2k, queries, doc: int, block: int) -> torch.Tensor:
    """int64: the local rows (of q2k) of the queries of document ``doc`` that selected its
    block ``block`` for some KV head."""
    hit = (q2k == block).any(-1).any(0)
    return (hit & (msa.token_documents[queries] == doc)).nonzero().squeeze(1)


def _row_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """float64 [S]: each row's ``||got - ref||`` over its reference's norm, or over the rows'
    mean norm where that is larger (a document's first token has dq = 0 exactly, and bf16
    leaves it a rounding residue); NaN fails."""
    diff = (got.double() - ref).flatten(1).norm(dim=1)
    norms = ref.flatten(1).norm(dim=1)
    errors = diff / torch.maximum(norms, norms.mean())
    return torch.where(torch.isfinite(got.double()).flatten(1).all(1), errors, float("nan"))


def _check_selection(iq, ik, msa, q2k, queries, sample):
    """The sampled rows' selection against the float64 one: equal sets, or sets that differ
    only by blocks whose float64 scores tie with the last one chosen (within 1e-3)."""
    rows = queries[sample]
    ref = select_rows_f64(iq, ik, msa, rows, top_k=TOPK, init_blocks=0, local_blocks=1,
                          block_size=BS, local=sample)
    got = q2k[:, sample]
    for i in range(rows.numel()):
        for h in range(HI):
            a, b = set(got[h, i].tolist()) - {-1}, set(ref[h, i].tolist()) - {-1}
            if a == b:
                continue
            # The float64 block scores of this row: the differing blocks must tie.
            start = int(msa.cu_seqlens[int(msa.token_documents[rows[i]])])
            pos = int(msa.document_positions[rows[i]])
            scores = iq[sample[i], h].double() @ ik[start:start + pos + 1].double().t()
            blocks = torch.nn.functional.pad(scores, (0, -(pos + 1) % BS),
                                             value=float("-inf")).view(-1, BS).amax(1)
            own = pos // BS
            last = min(float(blocks[x]) for x in b - {own})
            assert all(abs(float(blocks[x]) - last) <= 1e-3 for x in a ^ b), (int(rows[i]), h)


def _check(msa, iq, ik, q, k, v, dout, queries, sample, blocks):
    """Selection, forward and backward of the inputs (``queries``: the local queries' global
    rows; ``sample``: local rows to check; ``blocks``: (document, local block) pairs whose dk /
    dv to check) under every launch of :data:`SCHEDULES`."""
    subset = None if queries.numel() == msa.num_tokens else queries
    q2k = select_blocks(iq, ik, msa, top_k=TOPK, backend="triton", queries=subset)
    _check_selection(iq, ik, msa, q2k, queries, sample)
    scale = 1.0 / math.sqrt(D)
    ref_out, ref_lse, ref_dq = attention_rows_f64(q, k, v, dout, q2k, msa, queries[sample],
                                                  scale, BS, local=sample)
    selecting = torch.unique(torch.cat([_selecting(msa, q2k, queries, d, b) for d, b in blocks]))
    *_, ref_dk, ref_dv = attention_rows_f64(q, k, v, dout, q2k, msa, queries[selecting], scale,
                                            BS, local=selecting, kv_grads=True, chunk=64)
    for name, settings in SCHEDULES.items():
        with launch_overrides(settings):
            xs = [x.detach().requires_grad_(True) for x in (q, k, v)]
            out, lse = sparse_attention(*xs, q2k, msa, backend="triton", return_lse=True,
                                        queries=subset)
            out.backward(dout)
        dq, dk, dv = (x.grad for x in xs)
        for got, ref, what in ((out, ref_out, "out"), (dq, ref_dq, "dq")):
            errors = _row_errors(got[sample], ref)
            assert bool((errors < TOL).all()), (name, what, sample.tolist(), errors.tolist())
        assert rel_err(lse[:, sample], ref_lse) < TOL, (name, "lse")
        for doc, block in blocks:
            rows = _block_rows(msa, doc, block)
            assert rel_err(dk[rows].float(), ref_dk[rows]) < TOL, (name, "dk", doc, block)
            assert rel_err(dv[rows].float(), ref_dv[rows]) < TOL, (name, "dv", doc, block)
        del xs, out, lse, dq, dk, dv
        torch.cuda.empty_cache()


def test_one_gpu_past_2_31_elements():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    msa = _layout(DOCS)
    t = msa.num_tokens
    assert HQ * D * t > 2**31
    iq, ik = _randn(gen, t, HI, DI), _randn(gen, t, DI)
    q, k, v, dout = _randn(gen, t, HQ, D), _randn(gen, t, HKV, D), _randn(gen, t, HKV, D), \
        _randn(gen, t, HQ, D)
    first = 2**31 // (HQ * D)  # the first row past 2^31 elements
    end1 = DOCS[0]
    sample = torch.tensor([0, 1, 777, end1 - 1, end1, end1 + 1, 200000, first - 1, first,
                           first + 1, first + 1000, t - 13, t - 12, t - 2, t - 1], device=DEVICE)
    # Document 2's last (partial) block, its block holding row 262144, one in its middle, and
    # document 1's partial last block.
    blocks = [(1, (DOCS[1] - 1) // BS), (1, (first - end1) // BS), (1, 517),
              (0, (DOCS[0] - 1) // BS)]
    _check(msa, iq, ik, q, k, v, dout, torch.arange(t, device=DEVICE), sample, blocks)


def test_context_parallel_shard_past_2_31_elements():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    msa = _layout(CP_DOCS)
    t = msa.num_tokens
    queries = torch.sort(load_balanced_indices(t, 2, 0, device=DEVICE)).values
    tq = queries.numel()
    assert HQ * D * tq > 2**31
    iq, ik = _randn(gen, tq, HI, DI), _randn(gen, t, DI)
    q, k, v, dout = _randn(gen, tq, HQ, D), _randn(gen, t, HKV, D), _randn(gen, t, HKV, D), \
        _randn(gen, tq, HQ, D)
    first = 2**31 // (HQ * D)
    chunk = t // 4
    sample = torch.tensor([0, 1, 5000, chunk - 1, chunk, chunk + 1, first - 1, first, first + 1,
                           tq - 33, tq - 32, tq - 2, tq - 1], device=DEVICE)
    start2 = CP_DOCS[0]
    # Document 2's partial last block, its block holding the first local row past 2^31, one in
    # the middle of the local chunk 3; document 1's block 500 (chunk 0, local queries only).
    blocks = [(1, (CP_DOCS[1] - 1) // BS), (1, (int(queries[first]) - start2) // BS),
              (1, (3 * chunk + 30000 - start2) // BS), (0, 500)]
    _check(msa, iq, ik, q, k, v, dout, queries, sample, blocks)


#: The fused dense indexer loss's test: 16 KV (and index) heads of 16, one query head each, one
#: document of 140000 tokens. Its target and argmax keys are [16, T, ceil(T / 128)] (2.45e9
#: elements each, 9.8 GB): head 15's rows start past 2^31 although each head's rows do not.
LOSS_TOKENS, LOSS_HEADS, LOSS_DIM = 140000, 16, 16


def test_dense_indexer_loss_past_2_31_elements():
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    t, h, d = LOSS_TOKENS, LOSS_HEADS, LOSS_DIM
    assert (h - 1) * t * -(-t // BS) > 2**31 > t * -(-t // BS)
    _check_dense_loss(_layout((t,)), *(_randn(gen, *shape) for shape in ((t, h, d), (t, d),
                                                                         (t, h, d), (t, h, d))))


def _check_dense_loss(msa, iq, ik, query, key):
    """The fused dense indexer loss of every head at once against each head alone (index_q
    [T, H, d], index_k [T, d], query and key [T, H, d]: one query head per KV head)."""
    from nemo_msa.indexer_loss import dense_indexer_loss_triton

    h, d = iq.shape[1:]
    kw = dict(softmax_scale=1.0 / math.sqrt(d), num_index_heads_total=h, loss_coeff=1.0)

    def loss_and_grads(iq, query, key):
        iq, ik_ = iq.detach().requires_grad_(True), ik.detach().requires_grad_(True)
        loss, _ = dense_indexer_loss_triton(iq, ik_, query, key, msa, **kw)
        loss.backward()
        return loss.detach(), iq.grad, ik_.grad

    loss, diq, dik = loss_and_grads(iq, query, key)
    # Each head alone (its rows start at 0): the same programs on the same values, so the
    # same d index_q bits; the loss and d index_k add the heads up in another order.
    parts = [loss_and_grads(iq[:, g:g + 1], query[:, g:g + 1], key[:, g:g + 1])
             for g in range(h)]
    assert torch.isfinite(loss) and float(loss) > 0
    assert rel_err(loss, sum(p[0] for p in parts)) < 1e-5
    assert torch.equal(diq, torch.cat([p[1] for p in parts], 1))
    assert rel_err(dik.float(), sum(p[2].double() for p in parts)) < 1e-2
