"""Document-map recovery: source priority, every source, every malformed-map error."""

from __future__ import annotations

import pytest
import torch
from packs import document_map_from_rows

from nemo_msa import MSAMicrobatch


def block_causal_mask(ids: torch.Tensor) -> torch.Tensor:
    """bool [b, 1, s, s] as a packing loader builds it (True = keep)."""
    s = ids.shape[1]
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return (same & causal)[:, None]


IDS = document_map_from_rows([[(5, 2), (3, 0)], [(1, 0), (9, 0)]], seq_len=10)


def layout_summary(msa: MSAMicrobatch):
    return (
        msa.num_tokens,
        msa.num_documents,
        msa.cu_seqlens.tolist(),
        msa.document_positions.tolist(),
        msa.padding_mask.tolist(),
    )


def test_every_source_recovers_the_same_documents():
    expected = layout_summary(MSAMicrobatch.from_document_map(IDS, block_size=16))
    from_ids = MSAMicrobatch.build(packed_seq_ids=IDS.clone(), block_size=16)
    from_2d = MSAMicrobatch.build(attention_mask=IDS.clone() * 7, block_size=16)
    from_4d = MSAMicrobatch.build(attention_mask=block_causal_mask(IDS), block_size=16)
    assert layout_summary(from_ids) == expected
    assert layout_summary(from_2d) == expected
    assert layout_summary(from_4d) == expected
    assert expected[2] == [0, 5, 8, 9, 18]


def test_padding_mask_and_none_give_one_document_per_row():
    padding = torch.tensor([[False, False, True], [False, True, True]])
    msa = MSAMicrobatch.build(padding_mask=padding, block_size=16)
    assert msa.num_documents == 2 and msa.num_tokens == 3
    assert msa.cu_seqlens.tolist() == [0, 2, 3]
    assert torch.equal(msa.padding_mask, padding)
    plain = MSAMicrobatch.build(batch_size=2, seq_len=5, block_size=16)
    assert plain.num_documents == 2 and plain.num_tokens == 10
    assert plain.cu_seqlens.tolist() == [0, 5, 10]


def test_priority_order_packed_ids_first_then_attention_mask_then_padding():
    ids = torch.tensor([[1, 1, 2, 2]])
    other = torch.tensor([[1, 1, 1, 1]])
    padding = torch.tensor([[False, False, False, True]])
    assert MSAMicrobatch.build(ids, other, padding, block_size=16).num_documents == 2
    assert MSAMicrobatch.build(None, other, padding, block_size=16).num_documents == 1
    assert MSAMicrobatch.build(None, None, padding, block_size=16).num_tokens == 3


@pytest.mark.parametrize(
    "ids, message",
    [
        (torch.tensor([[1, -1, 0]]), "negative document ids in row 0"),
        (torch.tensor([[0, 0], [0, 0]]), "no real token"),
        (torch.tensor([[1, 1, 2, 2], [1, 2, 1, 0]]), "row 1 interrupts a document"),
        (torch.tensor([[1, 0, 1]]), "row 0 interrupts a document"),
    ],
)
def test_malformed_maps_raise_value_error(ids, message):
    with pytest.raises(ValueError, match=message):
        MSAMicrobatch.from_document_map(ids, block_size=16)


def test_empty_map_raises():
    with pytest.raises(ValueError, match="empty"):
        MSAMicrobatch.from_document_map(torch.zeros(0, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="empty"):
        MSAMicrobatch.build(batch_size=2, seq_len=0)


def test_coordinates_past_int32_raise():
    big = torch.ones(1, 1, dtype=torch.int64).expand(2**16, 2**15 + 1)
    with pytest.raises(ValueError, match="past int32"):
        MSAMicrobatch.from_document_map(big)


def test_four_d_mask_that_is_not_block_causal_names_the_first_bad_row():
    mask = block_causal_mask(IDS)
    mask[1, 0, 6, 2] = False  # batch 1, query 6 drops a key of its own document
    mask[1, 0, 8, 0] = True  # a later row also bad; the first must be named
    with pytest.raises(ValueError, match="first bad row is batch 1, query 6"):
        MSAMicrobatch.build(attention_mask=mask, block_size=16)
    padded = block_causal_mask(IDS)
    padded[0, 0, 5, 0] = True  # a padding row that keeps a key
    with pytest.raises(ValueError, match="batch 0, query 5"):
        MSAMicrobatch.build(attention_mask=padded, block_size=16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"packed_seq_ids": torch.ones(2, 3)}, "packed_seq_ids must be an integer tensor"),
        ({"attention_mask": torch.ones(2, 3, dtype=torch.bool)}, "integer document ids"),
        ({"attention_mask": torch.ones(2, 1, 3, 4, dtype=torch.bool)}, "4-D attention_mask"),
        ({"attention_mask": torch.ones(2, 3, 3)}, "attention_mask must be 2-D"),
        ({"padding_mask": torch.ones(2, 3)}, "padding_mask must be bool"),
        ({}, "batch_size and seq_len are required"),
    ],
)
def test_bad_sources_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MSAMicrobatch.build(**kwargs)


def test_declared_sizes_are_checked_against_the_source():
    with pytest.raises(ValueError, match="batch 2 but batch_size=3"):
        MSAMicrobatch.build(packed_seq_ids=IDS.clone(), batch_size=3)
