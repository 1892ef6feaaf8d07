"""Model FLOPs per step against a count by hand, and the MFU arithmetic."""

from __future__ import annotations

import pytest
import torch

from nemo_msa.training.flops import BF16_PEAK_FLOPS, FlopsModel, throughput

#: h=64, gated MLP 128, 4 query / 2 KV heads of dim 16, padded vocab 256, layers D then S,
#: blocks of 4 tokens, top-2, 2 index heads of dim 8.
SMALL = dict(hidden=64, ffn_hidden=128, gated=True, heads=4, kv_heads=2, head_dim=16,
             padded_vocab=256, msa_layers=(False, True), block_size=4, top_k=2, index_heads=2,
             index_dim=8, indexer_loss=True, log_recall=True)

#: One row of 20 tokens: a document of 10, one of 7, then 3 of padding.
IDS = torch.tensor([[1] * 10 + [2] * 7 + [0] * 3])

# By hand: keys seen by a dense causal query at positions 0..9 and 0..6: 55 + 28 = 83.
# With blocks of 4 and top-2, positions 0..7 see all their keys (at most 2 blocks): 36 (doc 1)
# and 28 (doc 2); positions 8 and 9 see one full block plus 1 and 2 keys of their own: 5 + 6.
KEYS_DENSE, KEYS_SEL, TOKENS = 83, 36 + 5 + 6 + 28, 20
# Per token and layer, forward: QKV 2*64*(4+2*2)*16 = 16384, out 2*4*16*64 = 8192,
# MLP 3 GEMMs 6*64*128 = 49152.
GEMM = (16384 + 8192 + 49152) * TOKENS * 3 * 2          # 2 layers, fwd + bwd
LOGITS = 2 * 64 * 256 * TOKENS * 3
ATTN_D = 4 * 4 * 16 * KEYS_DENSE * 3                     # QK^T and PV, fwd + bwd
INDEX_PROJ = 2 * 64 * (2 * 8 + 8) * TOKENS * 3           # index q (2 heads) and k (1 head)
SELECT = 2 * 2 * 8 * KEYS_DENSE                          # scores over every visible key, fwd


def test_sparse_step_matches_the_hand_count():
    attn_s = 4 * 4 * 16 * KEYS_SEL * 3
    dense_loss = 2 * 4 * 16 * KEYS_DENSE + 2 * 2 * 8 * KEYS_DENSE * 3
    sparse_loss = 2 * 2 * 8 * KEYS_SEL * 3
    base = GEMM + LOGITS + ATTN_D + attn_s + INDEX_PROJ + SELECT
    got = FlopsModel(**SMALL, indexer_loss_type="sparse").step_flops([IDS], warmup=False)
    assert got == base + sparse_loss
    got = FlopsModel(**SMALL, indexer_loss_type="dense").step_flops([IDS], warmup=False)
    assert got == base + dense_loss


def test_warmup_and_dense_layers_count_dense_causal_attention():
    dense_loss = 2 * 4 * 16 * KEYS_DENSE + 2 * 2 * 8 * KEYS_DENSE * 3
    want = GEMM + LOGITS + 2 * ATTN_D + INDEX_PROJ + SELECT + dense_loss
    assert FlopsModel(**SMALL, indexer_loss_type="sparse").step_flops([IDS], True) == want
    all_dense = dict(SMALL, msa_layers=(False, False))
    assert FlopsModel(**all_dense).step_flops([IDS], False) == GEMM + LOGITS + 2 * ATTN_D
    # Two microbatches count twice; padding rows cost GEMMs only.
    pad = torch.zeros_like(IDS)
    assert FlopsModel(**all_dense).step_flops([IDS, pad], False) == 2 * (GEMM + LOGITS) + 2 * ATTN_D


def test_from_config_reads_the_model():
    from nemo_msa.megatron import MSATransformerConfig, cpu_shim

    config = MSATransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, kv_channels=16, gated_linear_unit=True, msa_block_size=16,
        msa_topk=2, msa_index_head_dim=16, msa_layer_pattern="DS", msa_indexer_loss_type="sparse",
        **cpu_shim.cpu_config_overrides())
    model = FlopsModel.from_config(config, padded_vocab=256)
    assert model == FlopsModel(**dict(SMALL, index_dim=16, block_size=16),
                                indexer_loss_type="sparse")


def test_throughput_and_mfu():
    t = throughput(2e12, 0.5, 2, ("NVIDIA H200", BF16_PEAK_FLOPS["H200"]))
    assert t["tflops_per_gpu"] == pytest.approx(2.0)
    assert t["mfu"] == pytest.approx(2e12 / 989e12)
    assert "mfu" not in throughput(2e12, 0.5, 2, None)
