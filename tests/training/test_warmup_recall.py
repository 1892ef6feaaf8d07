"""The dense warm-up aligns the indexer with a structured main attention: recall rises.

On Megatron's mock data a small model's attention stays almost uniform within a document, so
every top-k selection holds about the same share of the mass and recall is flat (see
test_dense_warmup_trains_only_the_indexer). This test builds a corpus on which the trained main
attention is structured, and runs the warm-up as the recipe intends it: from a model that
already attends in a structured way, with a fresh indexer.

1. Phase 1: the main model learns (``freeze_main_during_warmup=false``) while the indexer stays
   at its initialisation (``msa_indexer_loss_coeff=1e-12``: under Adam, a gradient far below
   ``eps`` does not move it; the coefficient is kept > 0 so the indexer loss and recall are still
   measured). The indexer loss rises: the main attention moves away from what the untrained
   indexer predicts.
2. Phase 2, twice from phase 1's checkpoint, on the same batches with the main model frozen:
   the contract's warm-up (``msa_indexer_loss_coeff=1``: only the indexer learns), and a control
   in which the indexer does not learn either (coefficient 1e-12, as in phase 1). The statement
   is paired: on the same batches, the trained indexer's recall beats the untrained one's at
   every step and by a clear margin, and its loss falls well below the control's
   (:func:`indexer_learning_failures`). Comparing the warm-up against its own first steps
   instead depends on how fast the first few steps learn, which moves with torch versions and
   thread counts (issue #19: 0.862 -> 0.938 with torch 2.14, 0.75 -> 0.95 with torch 2.11).

The learning rate stays the same in both phases (resuming restores the optimizer's parameter
groups, which are keyed by learning rate) and is constant, so phase 2 does not start at the
end of a decay.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from nemo_msa.training.recipe import load_recipe
from nemo_msa.training.trainer import pretrain, teardown

PHASE1_STEPS = 150
PHASE2_STEPS = 40
COPY_LEN = 200
EOD = 255

MODEL = [
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.kv_channels=16",
    "model.msa_index_head_dim=16", "model.seq_length=512", "model.vocab_size=256",
    "model.rotary_percent=1.0", "model.msa_block_size=32", "model.msa_topk=4",
    "train.global_batch_size=2", "train.micro_batch_size=1", "train.seed=1234",
    "optimizer.lr=1.0e-2", "optimizer.min_lr=1.0e-2", "scheduler.lr_warmup_iters=1",
    "scheduler.lr_decay_style=constant", "logger.progress_bar=false", "logger.plot=false",
]


def _copy_corpus(prefix: str) -> None:
    """Writes an indexed corpus of copy documents ``[x_1 .. x_L] [x_1 .. x_L] [EOD]``.

    Why this data: a document of 401 tokens spans 13 blocks of 32, far more than the 4 a query
    selects, so attention spread over the document gives low recall, and the random tokens carry
    nothing a query can predict from its neighbours, so the model is pushed to look elsewhere
    (the second half repeats the first at a fixed distance). In phase 1's 150 steps the model
    does not solve the copy yet (its loss barely moves below ln 249), but its attention leaves
    the untrained indexer's picture: the indexer loss rises from about 0.09 to about 1.0, and
    the warm-up then lifts recall from about 0.75 to about 0.95. On mock data (counting
    sequences, where the current token gives the next) the same schedule leaves the indexer
    loss near 0.08 and recall near 0.55-0.68: there is no structure to learn.

    Args:
        prefix: path prefix of the ``.bin`` / ``.idx`` pair to write.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(400):
        tokens = rng.integers(1, 250, size=COPY_LEN).tolist()
        doc = tokens + tokens + [EOD]
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(prefix + ".idx")


def _train(overrides: list[str]) -> dict:
    try:
        return pretrain(load_recipe(None, MODEL + overrides))
    finally:
        teardown()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


#: The last phase-2 steps compared between the trained indexer and the control.
LAST = 10


def indexer_learning_failures(learn: list[dict], control: list[dict]) -> list[str]:
    """What the warm-up failed to show, comparing the phase-2 histories of the trained indexer
    and of the control on the same batches (empty when it learned).

    The margins are relative to what there is to learn: phase 1 leaves more or less structure
    depending on the seed (measured over the last 10 steps: seed 1234 control recall 0.73,
    trained 0.94; seed 7 control 0.80, trained 0.88), so the trained indexer must win every
    step, close at least a quarter of the recall the control misses, and cut the control's
    indexer loss by at least 30%.

    Args:
        learn: phase-2 rows (``recall``, ``indexer_loss``) of the warm-up that trains the
            indexer.
        control: the same steps with an indexer that does not learn.
    """
    failures = []
    learn, control = learn[-LAST:], control[-LAST:]
    gain = [a["recall"] - b["recall"] for a, b in zip(learn, control, strict=True)]
    if min(gain) <= 0:
        failures.append(f"the trained indexer's recall does not beat the control's at every "
                        f"step: gains {[round(g, 3) for g in gain]}")
    missed = 1.0 - _mean([h["recall"] for h in control])
    if _mean(gain) <= max(0.05, 0.25 * missed):
        failures.append(f"recall gain {_mean(gain):.3f} over the control is not above "
                        f"max(0.05, a quarter of the {missed:.3f} it misses)")
    loss = _mean([h["indexer_loss"] for h in learn])
    control_loss = _mean([h["indexer_loss"] for h in control])
    if loss >= 0.7 * control_loss:
        failures.append(f"indexer loss {loss:.3f} not below 0.7 x the control's "
                        f"{control_loss:.3f}")
    return failures


def test_dense_warmup_raises_recall_on_structured_attention(tmp_path: Path):
    prefix = str(tmp_path / "copy")
    _copy_corpus(prefix)
    data = [f"dataset.data_path=[{prefix}]", f"dataset.eod_id={EOD}",
            f"dataset.path_to_cache={tmp_path / 'cache'}"]

    _train(data + [
        f"train.train_iters={PHASE1_STEPS}", f"model.msa_dense_warmup_steps={PHASE1_STEPS}",
        "train.freeze_main_during_warmup=false", "model.msa_indexer_loss_coeff=1e-12",
        f"checkpoint.save={tmp_path / 'phase1'}",
    ])
    total = PHASE1_STEPS + PHASE2_STEPS
    phase2 = {}
    for name, coeff in (("learn", "1.0"), ("control", "1e-12")):
        summary = _train(data + [
            f"train.train_iters={total}", f"model.msa_dense_warmup_steps={total}",
            "train.freeze_main_during_warmup=true", f"model.msa_indexer_loss_coeff={coeff}",
            f"checkpoint.load={tmp_path / 'phase1'}", f"checkpoint.save={tmp_path / name}",
            # A longer run than phase 1's schedule: continue with this recipe's (lr is constant).
            "scheduler.override_opt_param_scheduler=true",
            # Another warm-up and indexer-loss weight than phase 1's: a deliberate change.
            "checkpoint.allow_recipe_change=true",
        ])
        assert summary["last phase"] == "dense-warmup"
        hist = summary["history"]  # phase 1's history travels with the checkpoint
        assert [h["iteration"] for h in hist] == list(range(1, total + 1))
        phase2[name] = hist[PHASE1_STEPS:]
    phase1 = hist[:PHASE1_STEPS]
    idx1 = [h["indexer_loss"] for h in phase1]

    # Phase 1: the main attention became structured, away from the untrained indexer.
    assert _mean(idx1[-5:]) > 3 * _mean(idx1[:5]), idx1
    # Same batches in both phase-2 runs: the data position travels with the checkpoint.
    assert [h["iteration"] for h in phase2["learn"]] == [h["iteration"] for h in
                                                          phase2["control"]]
    # Phase 2 (main model frozen): the indexer learns the attention; the control does not.
    failures = indexer_learning_failures(phase2["learn"], phase2["control"])
    assert not failures, (failures, [round(h["recall"], 3) for h in phase2["learn"]],
                          [round(h["recall"], 3) for h in phase2["control"]])
    # The criterion is not vacuous: the control measured against itself fails it.
    assert indexer_learning_failures(phase2["control"], phase2["control"])
