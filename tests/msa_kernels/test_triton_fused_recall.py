"""The sampled selection recall in Triton (issue #28: the torch pass scored every sampled row
against the whole workspace) equals the torch pass: sampled and exact (every token), packed
rows with padding, group sizes below and at the 16-row tile, and a selection with -1 slots."""

from __future__ import annotations

import pytest
import torch
from _msa_support import KERNEL_DEVICE

from nemo_msa import MSAMicrobatch, select_blocks
from nemo_msa.backends.triton import BACKEND
from nemo_msa.indexer_loss import sampled_selection_recall
from nemo_msa.testing.packs import document_map_from_lengths


@pytest.mark.parametrize(("num_rows", "hq", "hkv", "d"),
                         [(7, 8, 2, 32), (20, 32, 2, 16), (1000, 4, 2, 16)])
def test_fused_recall_equals_the_torch_pass(num_rows, hq, hkv, d):
    lengths = [[5, 40, 33], [70, 2]] if num_rows < 100 else [[5, 20], [33]]
    ids = document_map_from_lengths(lengths, 90, KERNEL_DEVICE)
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=16)
    gen = torch.Generator().manual_seed(num_rows)
    t = msa.num_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(KERNEL_DEVICE, torch.bfloat16)

    query, key, iq, ik = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, 16), rnd(t, 16)
    q2k = select_blocks(iq, ik, msa, top_k=2, backend=BACKEND)
    holey = q2k.clone()
    holey[:, ::3, 0] = -1
    for sel in (q2k, holey):
        got = sampled_selection_recall(query, key, sel, msa, softmax_scale=0.2,
                                       num_rows=num_rows, fused=True)
        want = sampled_selection_recall(query, key, sel, msa, softmax_scale=0.2,
                                        num_rows=num_rows, fused=False)
        assert float(got["recall_count"]) == float(want["recall_count"]) == min(num_rows, t) * hkv
        assert 0 < float(want["recall_mass"]) < float(want["recall_count"])
        assert abs(float(got["recall_mass"]) - float(want["recall_mass"])) \
            <= 1e-5 * float(want["recall_mass"])
