"""THD from the data path (``dataset.packed_format: thd``, ADR 0052): the rows of a microbatch end
to end with Megatron's PackedSeqParams at the EOD boundaries train to the document-id path's
losses, and the combinations the data path cannot run are refused when the recipe loads."""

from __future__ import annotations

import math

import pytest
import torch
from _runs import pretrain_cli, train

from nemo_msa.context_parallel.layout import thd_document_map
from nemo_msa.training.data import collate, thd_packed_seq_params
from nemo_msa.training.recipe import RecipeError, load_recipe

EOD = 9


def test_cu_seqlens_lay_the_rows_end_to_end_at_the_document_boundaries():
    # Row 0: three documents; row 1: two, then padding; row 2: all padding; row 3: one document.
    ids = torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3],
                        [1, 1, 1, 1, 2, 0, 0, 0],
                        [0, 0, 0, 0, 0, 0, 0, 0],
                        [1, 1, 1, 1, 1, 1, 1, 1]])
    params = thd_packed_seq_params(ids)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_kv is params.cu_seqlens_q
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 8, 12, 13, 21]
    # Padding belongs to the sequence before it (row 1's second document takes rows 2's too).
    assert params.cu_seqlens_q_padded.tolist() == [0, 3, 5, 8, 12, 24, 32]
    assert params.max_seqlen_q == params.max_seqlen_kv == 12
    # The pack's document map is the rows' map end to end (ids numbered over the pack).
    pack = thd_document_map(params.cu_seqlens_q, params.cu_seqlens_q_padded)[0]
    assert pack.tolist() == [1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5] + [0] * 11 + [6] * 8
    # A first row of padding alone is an empty sequence; no padding at all: no padded starts.
    lead = thd_packed_seq_params(torch.tensor([[0, 0, 0], [1, 2, 2]]))
    assert lead.cu_seqlens_q.tolist() == [0, 0, 1, 3]
    assert lead.cu_seqlens_q_padded.tolist() == [0, 3, 4, 6]
    assert thd_packed_seq_params(torch.tensor([[1, 2, 3]])).cu_seqlens_q_padded is None


def test_collate_carries_the_packed_seq_params_of_its_document_map():
    samples = [{"tokens": torch.tensor(t), "labels": torch.tensor(t[1:] + [0]),
                "loss_mask": torch.ones(6)}
               for t in ([3, EOD, 4, 5, EOD, 6], [7, 8, EOD, 2, 3, 4])]
    mb = collate(samples, EOD, torch.device("cpu"), packed_format="thd")
    assert mb.packed_seq_ids.tolist() == [[1, 1, 2, 2, 2, 3], [1, 1, 1, 2, 2, 2]]
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 2, 5, 6, 9, 12]
    assert mb.packed_seq_params.cu_seqlens_kv is mb.packed_seq_params.cu_seqlens_q
    assert collate(samples, EOD, torch.device("cpu")).packed_seq_params is None
    with pytest.raises(ValueError, match="packed_format='bhsd'"):
        collate(samples, EOD, torch.device("cpu"), packed_format="bhsd")


def test_thd_trains_to_the_document_id_losses(monkeypatch):
    """Same seed, same data: two rows per microbatch, 2 dense warm-up and 2 sparse steps, and an
    evaluation; LM loss, indexer loss and validation loss agree to float32 rounding."""
    from nemo_msa.context_parallel.layout import ContextParallelLayout

    built = []
    build_thd = ContextParallelLayout.build_thd

    def counting(*args, **kwargs):
        built.append(1)
        return build_thd(*args, **kwargs)

    monkeypatch.setattr(ContextParallelLayout, "build_thd", counting)
    common = ["train.train_iters=4", "model.msa_dense_warmup_steps=2", "train.micro_batch_size=2",
              "train.eval_interval=4", "train.eval_iters=1", "logger.plot=false"]
    runs = {}
    for fmt in ("bshd", "thd"):
        runs[fmt] = train([*common, f"dataset.packed_format={fmt}"])
        # The layers took THD input (their layout from cu_seqlens) in the THD run only.
        assert bool(built) == (fmt == "thd")
    bshd, thd = (runs[k]["history"] for k in ("bshd", "thd"))
    assert [h["iteration"] for h in thd] == [1, 2, 3, 4]
    for want, got in zip(bshd, thd, strict=True):
        for key in ("loss", "indexer_loss", "recall"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (key, want, got)
    assert thd[-1]["val_loss"] == pytest.approx(bshd[-1]["val_loss"], rel=1e-5)
    assert thd[-1]["loss"] < thd[0]["loss"] - 0.2  # it trains
    assert runs["thd"]["last phase"] == "sparse"


def test_recipe_refuses_what_the_thd_path_cannot_run():
    with pytest.raises(RecipeError, match=r"'dataset.packed_format' = 'sbhd': expected 'bshd'"):
        load_recipe(None, ["dataset.packed_format=sbhd"])
    with pytest.raises(RecipeError, match=r"'dataset.packed_format' = 'thd': expected 'bshd' "
                                          r"with model.context_parallel_size = 2"):
        load_recipe(None, ["dataset.packed_format=thd", "model.context_parallel_size=2"])
    assert load_recipe(None, ["dataset.packed_format=thd"]).dataset.packed_format == "thd"


@pytest.mark.gpu
def test_thd_follows_the_document_id_curve_with_the_triton_kernels(tmp_path):
    """On the GPU (bf16, the Triton kernels, two rows per microbatch): the THD run follows the
    document-id run. The first step's loss is the same function of the same weights (bf16
    rounding apart); the curves stay together over 12 steps (3 of dense warm-up)."""
    common = ["model.bf16=true", "optimizer.clip_grad=1.0", "model.msa_backend=triton",
              "train.train_iters=12", "model.msa_dense_warmup_steps=3",
              "train.micro_batch_size=2", "train.global_batch_size=4"]
    curves = {fmt: [r["loss"] for r in pretrain_cli(tmp_path / fmt, *common,
                                                     f"dataset.packed_format={fmt}")]
              for fmt in ("bshd", "thd")}
    bshd, thd = curves["bshd"], curves["thd"]
    print(curves)
    assert len(bshd) == len(thd) == 12
    assert all(math.isfinite(v) for v in bshd + thd)
    assert abs(thd[0] - bshd[0]) < 1e-2 * bshd[0], curves
    assert abs(sum(thd[-3:]) - sum(bshd[-3:])) / 3 < 0.1, curves
    assert thd[-1] < thd[0] - 0.5, curves
