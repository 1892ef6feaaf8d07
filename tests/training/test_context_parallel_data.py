"""Context parallelism on the training side: the data split, the loss normalisation, the recipe
checks and the indexer metrics' reduction device (fast, one process)."""

from __future__ import annotations

import pytest
import torch

from nemo_msa.context_parallel import load_balanced_indices
from nemo_msa.training.data import Microbatch, collate, split_microbatch
from nemo_msa.training.loop import _loss_func
from nemo_msa.training.recipe import RECIPES_DIR, RecipeError, check_parallel_layout, load_recipe

EOD = 99


@pytest.mark.parametrize("cp", [2, 4])
def test_split_matches_megatrons_get_batch_on_this_cp_rank(monkeypatch, cp):
    from megatron.core import utils as mcore_utils

    seq = 8 * cp
    batch = {"tokens": torch.arange(2 * seq).view(2, seq),
             "position_ids": torch.arange(2 * seq).view(2, seq) * 3}
    parts = []
    for rank in range(cp):
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: cp)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
        want = mcore_utils._get_batch_on_this_cp_rank_per_sequence_balancing(
            dict(batch), cp_group=None)
        cols = load_balanced_indices(seq, cp, rank)
        assert torch.equal(batch["tokens"][:, cols], want["tokens"])
        assert torch.equal(batch["position_ids"][:, cols], want["position_ids"])
        parts.append(cols)
    # The ranks' shares partition the sequence.
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(seq))


def test_collate_splits_rows_and_keeps_the_global_document_map():
    tokens = torch.tensor([5, 6, EOD, 7, 8, 9, EOD, 4])
    sample = {"tokens": tokens, "labels": torch.roll(tokens, -1),
              "loss_mask": torch.tensor([1.0, 1, 1, 0, 1, 1, 1, 0])}
    full = collate([sample], EOD, torch.device("cpu"))
    shares = [collate([sample], EOD, torch.device("cpu"), cp_size=2, cp_rank=r) for r in (0, 1)]
    cols = [[0, 1, 6, 7], [2, 3, 4, 5]]
    for mb, c in zip(shares, cols, strict=True):
        assert mb.cp_size == 2 and mb.tokens.shape == (1, 4)
        for name in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(getattr(mb, name), getattr(full, name)[:, c]), name
        # Document ids and positions come from the whole row, before the split.
        assert torch.equal(mb.packed_seq_ids, full.packed_seq_ids)
        assert float(mb.loss_tokens) == 6.0
    assert mb.position_ids.tolist() == [[2, 0, 1, 2]]  # document-local, from the whole row


def test_cp_loss_shares_average_to_the_cp1_loss():
    """Unequal loss tokens per rank: the schedule's normalisation (divide by the returned count)
    then DDP's average over the CP ranks gives the CP=1 mean, as does the per-token path."""
    torch.manual_seed(0)
    seq, cp = 16, 2
    per_token = torch.rand(1, seq, dtype=torch.float64)
    mask = (torch.rand(1, seq) > 0.3).float()
    mask[0, :4] = 0  # rank 0's first chunk has no loss tokens
    mb = Microbatch(torch.zeros(1, seq), torch.zeros(1, seq), mask, torch.zeros(1, seq),
                    torch.ones(1, seq))
    want = float((per_token * mask).sum() / mask.sum())
    mean_of_shares, sums, counts, naive = 0.0, 0.0, 0.0, 0.0
    for rank in range(cp):
        share = split_microbatch(mb, cp, rank)
        cols = load_balanced_indices(seq, cp, rank)
        loss, count, report = _loss_func(share, False, per_token[:, cols])
        mean_of_shares += float(loss / count) / cp
        loss, count, _ = _loss_func(share, True, per_token[:, cols])
        sums, counts = sums + float(loss), counts + int(count)
        naive += float(loss / count) / cp  # a mean of the ranks' means: not the CP=1 loss
        assert torch.allclose(report["lm loss"], torch.stack([loss, count.double()]).float())
    # The loss function works in fp32.
    assert mean_of_shares == pytest.approx(want, rel=1e-6)
    assert sums / counts == pytest.approx(want, rel=1e-6)
    assert naive != pytest.approx(want, rel=1e-3)
    loss, count, _ = _loss_func(split_microbatch(mb, 1, 0), False, per_token)
    assert float(loss / count) == pytest.approx(want, rel=1e-6)


def test_recipe_names_a_sequence_that_does_not_split():
    with pytest.raises(RecipeError, match=r"recipe key 'model.seq_length' = 260: expected a "
                                          r"multiple of 2 x model.context_parallel_size = 8"):
        load_recipe(None, ["model.seq_length=260", "model.context_parallel_size=4"])
    with pytest.raises(RecipeError, match=r"'model.seq_length' = 40: expected a multiple of "
                                          r"model.context_parallel_size x "
                                          r"tensor_model_parallel_size = 16 with sequence_par"):
        load_recipe(None, ["model.seq_length=40", "model.context_parallel_size=2",
                           "model.tensor_model_parallel_size=8", "model.sequence_parallel=true"])
    with pytest.raises(RecipeError, match=r"'model.context_parallel_size' = 0: expected 1 <="):
        load_recipe(None, ["model.context_parallel_size=0"])
    recipe = load_recipe(None, ["model.context_parallel_size=2"])
    with pytest.raises(RecipeError, match=r"context_parallel_size=2 = 2, but the world size is 3"):
        check_parallel_layout(recipe.model, 3, 2, 1, 4)


def test_the_1m_token_recipe_splits_over_cp8():
    recipe = load_recipe(RECIPES_DIR / "minimax_m3_msa_1m_cp8.yaml")
    assert recipe.gpt.seq_length == 1 << 20 and recipe.model["context_parallel_size"] == 8
    model, train = recipe.model, recipe.train
    # TP=4 x CP=8 = 32 GPUs per replica; 64 GPUs give DP=2; 48 do not fit.
    assert check_parallel_layout(model, 32, train.global_batch_size, 1, 32) == 1
    assert check_parallel_layout(model, 64, train.global_batch_size, 1, 32) == 2
    with pytest.raises(RecipeError, match="but the world size is 48"):
        check_parallel_layout(model, 48, train.global_batch_size, 1, 32)


def test_indexer_metrics_reduce_on_the_device_of_the_backend(monkeypatch):
    """NCCL needs CUDA tensors even when no layer recorded anything (issue #26 item 3)."""
    from nemo_msa.megatron.indexer_loss import collective_device

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert collective_device() == torch.device("cpu")
