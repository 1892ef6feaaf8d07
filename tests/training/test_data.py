"""Packed data: document ids and positions from EOD tokens, real indexed datasets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_msa.training.data import (
    MicrobatchSource,
    build_train_dataset,
    check_token_range,
    collate,
    packed_seq_ids_from_tokens,
    positions_from_document_ids,
)
from nemo_msa.training.recipe import RecipeError, load_recipe

EOD = 99


def test_document_ids_split_after_eod_and_zero_padding():
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, 8, 9, 10],
                           [1, 2, 3, EOD, 4, 0, 0, 0]])
    padding = torch.tensor([[False] * 8, [False] * 5 + [True] * 3])
    ids = packed_seq_ids_from_tokens(tokens, EOD, padding)
    assert ids.tolist() == [[1, 1, 1, 2, 2, 3, 3, 3], [1, 1, 1, 1, 2, 0, 0, 0]]
    assert positions_from_document_ids(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2],
                                                         [0, 1, 2, 3, 0, 0, 0, 0]]


def test_collate_marks_megatron_padding_tail():
    sample = {"tokens": torch.tensor([3, EOD, 4, 0, 0]), "labels": torch.tensor([EOD, 4, 0, 0, 0]),
              "loss_mask": torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0])}
    mb = collate([sample], EOD, torch.device("cpu"))
    # Position 2 (token 4, label 0, loss 0) is real: only the trailing all-dead run is padding.
    assert mb.packed_seq_ids.tolist() == [[1, 1, 2, 0, 0]]


def _write_corpus(prefix: str, docs: list[list[int]]) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)])
    builder.finalize(prefix + ".idx")


def test_real_indexed_dataset_packs_documents(tmp_path):
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(40):
        length = int(rng.integers(5, 90))
        docs.append([int(t) for t in rng.integers(1, 90, size=length)] + [EOD])
    prefix = str(tmp_path / "corpus")
    _write_corpus(prefix, docs)
    recipe = load_recipe(None, [f"dataset.data_path=[{prefix}]", "dataset.eod_id=99",
                                "model.vocab_size=128", "model.seq_length=64",
                                f"dataset.path_to_cache={tmp_path / 'cache'}"])
    dataset = build_train_dataset(recipe.dataset, recipe.gpt, seed=3, num_samples=16)
    source = MicrobatchSource(dataset, micro_batch_size=2, global_batch_size=4, dp_size=1,
                              dp_rank=0, eod_id=EOD, device=torch.device("cpu"))
    micro = source.step_microbatches()
    assert len(micro) == 2 and source.consumed_samples == 4
    for mb in micro:
        tokens, ids, pos = mb.tokens, mb.packed_seq_ids, mb.position_ids
        assert tokens.shape == ids.shape == (2, 64)
        for row in range(2):
            eods = (tokens[row] == EOD).nonzero().flatten().tolist()
            # A new document starts right after every EOD, and only there.
            starts = [0] + [i + 1 for i in eods if i + 1 < 64]
            changes = [0] + [i for i in range(1, 64) if ids[row, i] != ids[row, i - 1]]
            assert changes == starts
            assert (pos[row, starts] == 0).all()
            assert ids[row].min() >= 1  # no padding in the training split
        # Labels are the next tokens of the same stream.
        assert torch.equal(mb.labels[:, :-1], mb.tokens[:, 1:])
    # Resuming at consumed_samples gives the same next microbatches.
    again = MicrobatchSource(dataset, micro_batch_size=2, global_batch_size=4, dp_size=1,
                             dp_rank=0, eod_id=EOD, device=torch.device("cpu"),
                             consumed_samples=4)
    nxt = source.step_microbatches()
    assert torch.equal(again.step_microbatches()[0].tokens, nxt[0].tokens)


def test_token_ids_outside_the_vocabulary_are_refused_when_the_dataset_opens(tmp_path):
    prefix = str(tmp_path / "corpus")
    _write_corpus(prefix, [[5, 6, 200, EOD], [7, 8, EOD]])
    recipe = load_recipe(None, [f"dataset.data_path=[{prefix}]", "dataset.eod_id=99",
                                "model.vocab_size=128", "model.seq_length=8",
                                f"dataset.path_to_cache={tmp_path / 'cache'}"])
    with pytest.raises(RecipeError, match=r"'model.vocab_size' = 128: dataset .*corpus.bin holds "
                                          r"token id 200, outside 0 <= id < model.vocab_size "
                                          r"\(expected a vocabulary at least 201 large"):
        build_train_dataset(recipe.dataset, recipe.gpt, seed=3, num_samples=4)
    assert check_token_range(prefix, 201) == 200
    # uint16 data cannot exceed a vocabulary of 65536 or more: nothing to scan.
    assert check_token_range(prefix, 65536) == 65535
