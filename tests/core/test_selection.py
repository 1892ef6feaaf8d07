"""Block selection against a brute-force float64 implementation written here, independently."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from packs import packed_batches

from nemo_msa import MSAMicrobatch, select_blocks


def brute_force_selection(ids, index_q, index_k, block, top_k, init_blocks, local_blocks, score):
    """Per document, per head, per query: score every candidate block, sort in Python."""
    q = index_q.double()
    k = index_k.double()
    heads = q.shape[1]
    out = torch.full((heads, q.shape[0], top_k), -1, dtype=torch.int32)
    token = 0
    for row in ids.tolist():
        c = 0
        while c < len(row):
            if row[c] <= 0:
                c += 1
                continue
            start = c
            while c < len(row) and row[c] == row[start]:
                c += 1
            length = c - start
            kd = k[token : token + length]
            for h in range(heads):
                s = q[token : token + length, h] @ kd.T  # [L, L]
                if score == "lse":
                    s = s / math.sqrt(q.shape[-1])
                for p in range(length):
                    own = p // block
                    ranked = []
                    for b in range(own + 1):
                        vis = s[p, b * block : min(p + 1, (b + 1) * block)]
                        val = vis.max() if score == "max" else torch.logsumexp(vis, 0)
                        val = float(val)
                        forced = b < init_blocks or b > own - local_blocks
                        nan = math.isnan(val)
                        # Sort key: forced first, then non-NaN, then higher score, then lower id.
                        ranked.append((not forced, nan, -(0.0 if nan else val), b))
                    chosen = sorted(sorted(ranked)[:top_k], key=lambda r: r[3])
                    for i, r in enumerate(chosen):
                        out[h, token + p, i] = r[3]
            token += length
    return out


@settings(max_examples=25, deadline=None)
@given(
    packed_batches(max_batch=2, max_seq=700, block_sizes=(16, 32)),
    st.integers(1, 8),
    st.integers(0, 2),
    st.integers(0, 2),
    st.sampled_from(["max", "lse"]),
    st.integers(0, 2**31 - 1),
)
def test_selection_equals_brute_force(case, top_k, init_blocks, local_blocks, score, seed):
    ids, block = case
    if init_blocks + local_blocks > top_k:
        init_blocks = 0
        local_blocks = min(local_blocks, top_k)
    msa = MSAMicrobatch.from_document_map(
        ids, block_size=block, init_blocks=init_blocks, local_blocks=local_blocks
    )
    g = torch.Generator().manual_seed(seed)
    # float64 random inputs: ties have probability zero.
    index_q = torch.randn(msa.num_tokens, 2, 16, generator=g, dtype=torch.float64)
    index_k = torch.randn(msa.num_tokens, 16, generator=g, dtype=torch.float64)
    got = select_blocks(index_q, index_k, msa, top_k=top_k, score=score, backend="reference")
    want = brute_force_selection(
        ids, index_q, index_k, block, top_k, init_blocks, local_blocks, score
    )
    assert got.dtype == torch.int32 and got.shape == (2, msa.num_tokens, top_k)
    mismatch = (got != want).any(-1).nonzero()
    assert mismatch.numel() == 0, f"{len(mismatch)} rows differ; first {mismatch[:3].tolist()}"


def test_production_topology_selection_on_bf16_inputs():
    ids = torch.tensor([[1] * 1500 + [2] * 548])
    msa = MSAMicrobatch.build(packed_seq_ids=ids)  # block 128, init 0, local 1
    g = torch.Generator().manual_seed(1)
    index_q = torch.randn(msa.num_tokens, 4, 128, generator=g).bfloat16()
    index_k = torch.randn(msa.num_tokens, 128, generator=g).bfloat16()
    got = select_blocks(index_q, index_k, msa, top_k=16)
    want = brute_force_selection(ids, index_q, index_k, 128, 16, 0, 1, "max")
    assert torch.equal(got, want)
    # 1500 tokens = 12 blocks: fewer than 16 candidates, so every block is taken, -1 tail.
    last = got[:, 1499]
    assert last[:, :12].tolist() == [list(range(12))] * 4 and torch.all(last[:, 12:] == -1)
    # The second document's first token sees only its own block 0.
    assert got[0, 1500].tolist() == [0] + [-1] * 15


def test_ties_go_to_the_lower_block_and_nan_ranks_last():
    ids = torch.ones(1, 8 * 16, dtype=torch.int64)
    msa = MSAMicrobatch.from_document_map(ids, block_size=16, local_blocks=1)
    index_k = torch.ones(128, 4, dtype=torch.float64)  # every key identical: all scores tie
    index_q = torch.ones(128, 1, 4, dtype=torch.float64)
    got = select_blocks(index_q, index_k, msa, top_k=3, backend="reference")
    assert got[0, 127].tolist() == [0, 1, 7]  # own block forced, then lowest ids
    index_k = index_k.clone()
    index_k[0] = math.nan  # block 0 scores NaN
    index_k[16:32] = 2.0  # block 1 scores highest
    got = select_blocks(index_q, index_k, msa, top_k=3, backend="reference")
    assert got[0, 127].tolist() == [1, 2, 7]
    # With room for every candidate, the NaN block is still chosen (it is a candidate).
    got = select_blocks(index_q, index_k, msa, top_k=8, backend="reference")
    assert got[0, 127].tolist() == list(range(8))


def test_forced_init_and_local_blocks_count_inside_top_k():
    ids = torch.ones(1, 10 * 16, dtype=torch.int64)
    msa = MSAMicrobatch.from_document_map(ids, block_size=16, init_blocks=1, local_blocks=2)
    g = torch.Generator().manual_seed(3)
    index_q = torch.randn(160, 1, 8, generator=g, dtype=torch.float64)
    index_k = torch.randn(160, 8, generator=g, dtype=torch.float64)
    index_k[16 * 4 : 16 * 5] *= 100  # block 4 dominates every score
    got = select_blocks(index_q.abs(), index_k.abs(), msa, top_k=4, backend="reference")
    row = got[0, 159].tolist()
    assert row[0] == 0 and 8 in row and 9 in row and 4 in row


@pytest.mark.parametrize(
    "change, message",
    [
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": 33}, "msa_topk=33: the reference"),
        ({"score": "mean"}, "score='mean'"),
        ({"index_q": torch.zeros(5, 2, 8, dtype=torch.int64)},
         "index_q has dtype torch.int64; expected a floating-point"),
        ({"index_k": torch.zeros(5, 4)}, "index_k dim 4"),
        ({"index_k": torch.zeros(4, 8)}, "tokens=5"),
    ],
)
def test_bad_selection_inputs_name_the_argument(change, message):
    msa = MSAMicrobatch.build(batch_size=1, seq_len=5, block_size=16)
    args = {"index_q": torch.zeros(5, 2, 8), "index_k": torch.zeros(5, 8), "top_k": 4,
            "score": "max"}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        select_blocks(args.pop("index_q"), args.pop("index_k"), msa, **args)


def test_forced_blocks_beyond_top_k_are_refused():
    msa = MSAMicrobatch.build(batch_size=1, seq_len=5, block_size=16, init_blocks=2,
                              local_blocks=2)
    with pytest.raises(ValueError, match="exceeds top_k=3"):
        select_blocks(torch.zeros(5, 1, 8), torch.zeros(5, 8), msa, top_k=3)
