"""benchmarks/layer_bench/pairs.py (the attention work of bench_layer.py's rows, in (query, key)
pairs, and the MSA rows' pair rate against cuDNN) against brute force, on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from layer_bench.pairs import (
    FLOPS_PER_PAIR_CHANNEL,
    dense_pairs,
    dense_prefix,
    document_pairs,
    pair_rate,
    selected_pairs,
)
from layer_bench.selection import CoreAttentionCall

from nemo_msa import MSAMicrobatch, QueryView
from nemo_msa.ops import document_attention

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

BLOCK = 16


def _brute(length: int, block: int, top_k: int) -> tuple[int, int]:
    """Per query, the visible keys of each visible block; MSA keeps its own block and at most
    top_k - 1 others, at best the fullest."""
    dense = sparse = 0
    for p in range(length):
        keys = [min(block, p + 1 - b * block) for b in range(p // block + 1)]
        dense += sum(keys)
        sparse += keys[-1] + sum(sorted(keys[:-1], reverse=True)[:top_k - 1])
    return dense, sparse


def _layout(lengths: list[int], block: int = BLOCK) -> MSAMicrobatch:
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    return MSAMicrobatch.build(packed_seq_ids=ids.view(1, -1), block_size=block)


def _brute_selected(q2k: torch.Tensor, lengths: list[int], block: int) -> float:
    """Per KV head and token, every key of the document that lies in a valid selected block
    (an id in 0..own block, counted once) and not after the query; the mean over KV heads."""
    positions = [p for n in lengths for p in range(n)]
    total = 0
    for head in range(q2k.shape[0]):
        for token, p in enumerate(positions):
            chosen = {b for b in q2k[head, token].tolist() if 0 <= b <= p // block}
            total += sum(1 for j in range(p + 1) if j // block in chosen)
    return total / q2k.shape[0]


@pytest.mark.parametrize("length,block,top_k", [(1, 4, 2), (7, 4, 2), (8, 4, 2), (9, 4, 2),
                                                (37, 4, 3), (100, 8, 4), (33, 16, 1)])
def test_document_pairs_match_brute_force(length, block, top_k):
    assert document_pairs(length, block, top_k) == _brute(length, block, top_k)


def test_short_document_is_dense():
    # Up to top_k blocks, MSA attends every visible key: the selection is the whole causal mask.
    dense, sparse = document_pairs(2048, 128, 16)
    assert sparse == dense
    dense, sparse = document_pairs(2049, 128, 16)
    # The query at 2048 sees 17 blocks: its own (one key) and 15 of the 16 full ones.
    assert sparse == dense - 128


def test_dense_pairs_sum_the_documents():
    lengths = [37, 20, 1]
    assert dense_pairs(lengths) == sum(document_pairs(n, BLOCK, 1)[0] for n in lengths)
    assert dense_pairs([4]) == 10


def test_selected_pairs_match_brute_force_with_invalid_slots():
    # Two documents (37 and 20 tokens, blocks of 16: 3 and 2 blocks), 2 KV heads, 4 slots, with
    # every kind of slot the kernels ignore: -1, a negative id, an id past the token's own block
    # (a later block of its document, or past the document), and a duplicate.
    lengths = [37, 20]
    msa = _layout(lengths)
    generator = torch.Generator().manual_seed(0)
    q2k = torch.randint(-2, 4, (2, sum(lengths), 4), generator=generator, dtype=torch.int32)
    q2k[0, 40] = torch.tensor([1, 1, -1, 7], dtype=torch.int32)  # doc 2, position 3: own block 0
    q2k[1, 36] = torch.tensor([2, 0, 2, 0], dtype=torch.int32)  # doc 1, position 36: own block 2
    expected = _brute_selected(q2k, lengths, BLOCK)
    assert selected_pairs(q2k, msa) == expected
    # The hand-made rows alone: doc 2's query at position 3 (own block 0) keeps nothing (block 1
    # is later, block 7 past the document); doc 1's query at 36 (own block 2) keeps its own
    # block's 5 visible keys (32..36) and block 0's 16.
    one = torch.full((1, sum(lengths), 4), -1, dtype=torch.int32)
    one[0, 40] = q2k[0, 40]
    one[0, 36] = q2k[1, 36]
    assert selected_pairs(one, msa) == 5 + 16
    # Any selection of at most top_k blocks stays within the analytic bound.
    valid = torch.randint(0, 3, (2, sum(lengths), 2), generator=generator, dtype=torch.int32)
    bound = sum(document_pairs(n, BLOCK, 2)[1] for n in lengths)
    assert selected_pairs(valid, msa) <= bound


def test_full_selection_is_dense():
    # top_k >= the visible blocks: every token keeps all its blocks, so MSA attends every pair.
    lengths = [37, 20, 16, 1]
    msa = _layout(lengths)
    positions = msa.document_positions.long()
    slots = torch.arange(4)
    ids = torch.where(slots[None, :] <= (positions // BLOCK)[:, None], slots[None, :], -1)
    q2k = ids.to(torch.int32).expand(3, -1, -1).contiguous()
    assert selected_pairs(q2k, msa) == dense_pairs(lengths) == dense_pairs(msa.document_lengths)


class _Core(torch.nn.Module):
    """A core attention as MSACoreAttention calls it (document_attention with its scale)."""

    softmax_scale = 0.125

    def forward(self, query, key, value, msa, **kwargs):
        return document_attention(query, key, value, msa, softmax_scale=self.softmax_scale,
                                  **kwargs)


def _call(msa, q2k, mass: bool, seed: int, heads: int = 4, dim: int = 16
          ) -> CoreAttentionCall:
    """A captured reference-backend call on random q/k/v (``q2k``'s KV heads) over ``msa``."""
    generator = torch.Generator().manual_seed(seed)
    tokens, kv_heads = msa.document_positions.numel(), q2k.shape[0]
    q, k, v = (torch.randn(tokens, h, dim, generator=generator)
               for h in (heads, kv_heads, kv_heads))
    return CoreAttentionCall(_Core(), (q, k, v, msa), {
        "q2k": q2k, "backend": "reference", "return_block_mass": mass})


@pytest.mark.parametrize("mass", [False, True])
def test_pair_rate_times_both_sides_on_the_same_call(mass):
    lengths = [37, 20, 7]
    msa = _layout(lengths)
    tokens, heads, dim = sum(lengths), 4, 16
    q2k = torch.randint(-1, 3, (2, tokens, 2), generator=torch.Generator().manual_seed(1),
                        dtype=torch.int32)
    call = _call(msa, q2k, mass, seed=1)
    q = call.args[0]
    row = pair_rate(call, on_gpu=False, warmup=1, reps=2)
    assert row["pairs_dense"] == dense_pairs(lengths)
    assert row["pairs_msa"] == _brute_selected(q2k, lengths, BLOCK)
    for key in ("msa_attention_ms", "cudnn_attention_ms", "pair_rate_vs_cudnn",
                "msa_attention_tflops", "cudnn_attention_tflops"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    assert row["pair_rate_vs_cudnn"] == pytest.approx(
        row["msa_attention_tflops"] / row["cudnn_attention_tflops"])
    assert row["cudnn_attention_tflops"] == pytest.approx(
        FLOPS_PER_PAIR_CHANNEL * heads * dim * row["pairs_dense"]
        / row["cudnn_attention_ms"] / 1e9)
    # The captured inputs are left as they were (the timed calls run on clones).
    assert q.grad is None and not q.requires_grad
    with pytest.raises(ValueError, match="query subset"):
        pair_rate(CoreAttentionCall(call.module,
                                    (*call.args[:3], QueryView(msa, torch.arange(tokens))),
                                    call.kwargs),
                  on_gpu=False, warmup=1, reps=1)


def _own_and_previous(msa) -> torch.Tensor:
    """Each token's own block and the one before it (top-2): dense for the first two blocks of
    each document, sparse after them."""
    own = msa.document_positions.long() // BLOCK
    ids = torch.stack([own, torch.where(own > 0, own - 1, -1)], -1)
    return ids.to(torch.int32).expand(2, -1, -1).contiguous()


def test_the_dense_prefix_is_each_documents_first_blocks_when_all_are_selected():
    lengths = [37, 20, 40]
    msa = _layout(lengths)
    rows, prefix = dense_prefix(_own_and_previous(msa), msa)
    assert prefix == [32, 20, 32]  # min(length, top_k * block)
    starts = [0, 37, 57]
    assert rows.tolist() == [s + i for s, m in zip(starts, prefix, strict=True) for i in range(m)]
    # A token late in a document that selects everything while an earlier one does not is not
    # a prefix: no split.
    q2k = _own_and_previous(msa).clone()
    q2k[:, 3, 0] = -1  # token 3 of document 0 drops its own block
    assert dense_prefix(q2k, msa) is None


@pytest.mark.parametrize("mass", [False, True])
def test_pair_rate_splits_the_dense_prefix_from_the_rest(mass):
    msa = _layout([37, 20, 40])
    call = _call(msa, _own_and_previous(msa), mass, seed=2)
    q, k, v = call.args[:3]
    row = pair_rate(call, on_gpu=False, warmup=1, reps=1)
    assert row["prefix_tokens"] == 84
    assert row["pairs_msa_prefix"] == dense_pairs([32, 20, 32])
    assert row["pairs_msa_prefix"] < row["pairs_msa"] < row["pairs_dense"]
    for key in ("msa_prefix_ms", "msa_rest_ms", "cudnn_prefix_ms", "prefix_pair_rate_vs_cudnn",
                "rest_pair_rate_vs_cudnn"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    assert row["prefix_pair_rate_vs_cudnn"] == pytest.approx(
        row["cudnn_prefix_ms"] / row["msa_prefix_ms"])
    # A row whose every token is dense has nothing to split.
    full = pair_rate(CoreAttentionCall(call.module, (q[:20], k[:20], v[:20], _layout([20])), {
        **call.kwargs, "q2k": _own_and_previous(_layout([20]))}), on_gpu=False, warmup=1, reps=1)
    assert "prefix_tokens" not in full
