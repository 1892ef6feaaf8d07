"""Retrieval probes (ADR 0040): rows, buckets, determinism, scoring, CP split, recipe keys, a run.

The construction tests use a hand-made "validation split" (a list of token rows with end-of-
document and marker tokens in it) so that every planted position can be computed by hand.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from _runs import SMALL, train

from nemo_msa.context_parallel import load_balanced_indices
from nemo_msa.training.evaluate import probe_microbatches
from nemo_msa.training.probes import (
    MQAR_DISTANCES,
    PASSKEY_DEPTHS,
    ProbeSettings,
    build_probes,
    distance_bucket,
    probe_metrics,
    score_positions,
)
from nemo_msa.training.recipe import RecipeError, load_recipe

EOD = 255
#: The hand-made split: 6 samples of 40 tokens counting up from 100 + 39 i, the passkey marker
#: (1) and the MQAR marker (2) at their 4th and 8th token and an EOD at their end.
SPLIT = [{"tokens": torch.tensor([*range(100 + 39 * i, 139 + 39 * i), EOD])} for i in range(6)]
for _s in SPLIT:
    _s["tokens"][3], _s["tokens"][7] = 1, 2


def _rows(n: int, length: int) -> list[np.ndarray]:
    """What the haystack rows must be: each starts at the next unread sample, the samples'
    tokens without EOD and markers (37 a sample), cut to ``length``."""
    text = [s["tokens"].numpy()[[i for i in range(40) if i not in (3, 7, 39)]] for s in SPLIT]
    out, cursor = [], 0
    for _ in range(n):
        need = -(-length // 37)
        out.append(np.concatenate([text[(cursor + j) % 6] for j in range(need)])[:length])
        cursor += need
    return out


def test_passkey_rows_plant_the_key_at_each_depth_and_ask_for_it_at_the_end():
    s, k = 64, 4
    settings = ProbeSettings(kinds=("passkey",), rows=1, seed=3, key_length=k)
    probes = build_probes(SPLIT, settings, s, EOD)
    assert probes.rows == 5 and probes.tokens.shape == (5, s)
    assert probes.names == [f"passkey/{name}" for name, _, _ in PASSKEY_DEPTHS]
    last = s + 1 - 2 * k - 2  # 55: the needle's last possible position
    hay = _rows(5, s + 1)
    for r in range(5):
        row = torch.cat([probes.tokens[r], probes.labels[r, -1:]]).numpy()
        assert torch.equal(probes.tokens[r, 1:], probes.labels[r, :-1])
        (pos, depth), = probes.planted[r][1]
        key = row[s - k + 1:]
        assert row[s - k] == 1 and row[pos] == 1 and np.array_equal(row[pos + 1:pos + 1 + k], key)
        assert ((key >= 65) & (key < 91)).all()
        # The scored labels are the question's key tokens, in this row's depth bucket.
        group = probes.group[r]
        assert (group[s - k:] == r).all() and (group[:s - k] == -1).all()
        assert torch.equal(probes.labels[r, s - k:], torch.from_numpy(key))
        # Everything else is the held-out text in order, EOD and markers removed.
        planted = np.zeros(s + 1, dtype=bool)
        planted[pos:pos + 1 + k] = planted[s - k:] = True
        assert np.array_equal(row[~planted], hay[r][~planted])
        assert depth == pytest.approx(pos / last)
    positions = [p[1][0][0] for p in probes.planted]
    assert positions[1:4] == [14, 28, 41]  # floor(0.25 * 55 + .5), 0.5 and 0.75 likewise
    assert 0 <= positions[0] <= 6 and 50 <= positions[4] <= last


def test_mqar_rows_put_pairs_early_and_queries_late_with_distance_buckets():
    s, pairs = 128, 6
    settings = ProbeSettings(kinds=("mqar",), rows=2, seed=5, mqar_pairs=pairs)
    probes = build_probes(SPLIT, settings, s, EOD)
    assert probes.names == [f"mqar/{name}" for name in MQAR_DISTANCES]
    seen = set()
    for r in range(2):
        row = torch.cat([probes.tokens[r], probes.labels[r, -1:]]).numpy()
        items = probes.planted[r][1]
        assert len(items) == pairs
        keys = set()
        want_group = torch.full((s,), -1)
        for p, q in items:
            q = int(q)
            assert p + 5 <= s - s // 4 <= q and q + 5 <= s + 1
            assert row[p] == 2 and row[q] == 2 and np.array_equal(row[p:p + 5], row[q:q + 5])
            keys.add(tuple(row[p + 1:p + 3]))
            want_group[q + 2:q + 4] = distance_bucket(q - p, s)
            seen.add(distance_bucket(q - p, s))
        assert len(keys) == pairs  # distinct keys: every query has one answer
        assert torch.equal(probes.group[r], want_group)
        assert (row == 2).sum() == 2 * pairs
    assert len(seen) >= 2
    assert [distance_bucket(d, 128) for d in (0, 31, 32, 64, 96, 127, 128)] == [
        0, 0, 1, 2, 3, 3, 3]


def test_probes_are_deterministic_and_the_same_for_every_arm():
    settings = ProbeSettings(kinds=("passkey", "mqar"), rows=2, seed=7, key_length=4,
                             mqar_pairs=4)
    a, b = build_probes(SPLIT, settings, 96, EOD), build_probes(SPLIT, settings, 96, EOD)
    for name in ("tokens", "labels", "group"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    other = build_probes(SPLIT, ProbeSettings(**{**settings.__dict__, "seed": 8}), 96, EOD)
    assert not torch.equal(a.tokens, other.tokens)
    # The arms of the quality bench: same data, split, seed and length, other attention.
    from nemo_msa.training.data import build_gpt_datasets
    common = ["model.seq_length=128", "model.vocab_size=256", "dataset.split=80,20,0",
              "train.eval_interval=2", "train.eval_probes=[passkey,mqar]",
              "train.eval_probe_mqar_pairs=4"]
    rows = []
    for arm in ([], ["model.msa_layer_pattern=DDDD"], ["model.msa_topk=1"]):
        r = load_recipe(None, [*common, "model.num_layers=4", *arm])
        _, valid = build_gpt_datasets(r.dataset, r.gpt, r.train.seed, 8, 4)
        rows.append(build_probes(valid, ProbeSettings.from_train(r.train, 128), 128, 255))
    for other in rows[1:]:
        assert torch.equal(rows[0].tokens, other.tokens)
        assert torch.equal(rows[0].group, other.group)


def test_scoring_counts_argmax_hits_and_label_loss_per_bucket():
    # 4 scored positions over a vocabulary of 6 padded to 8; the padding logit is the largest
    # at position 0 and must not count.
    logits = torch.full((4, 8), -5.0)
    labels = torch.tensor([2, 3, 0, 5])
    group = torch.tensor([0, 0, 1, 1])
    logits[0, 2], logits[0, 7] = 4.0, 9.0    # hit (padding ignored)
    logits[1, 1], logits[1, 3] = 4.0, 1.0    # miss
    logits[2, 0] = 2.0                        # hit
    logits[3, 5] = 3.0                        # hit
    got = score_positions(logits.to(torch.bfloat16), labels, group, 2, 6)
    real = logits[:, :6]
    ce = -torch.log_softmax(real.double(), dim=-1)[torch.arange(4), labels]
    assert got[0].tolist() == [1.0, 2.0] and got[2].tolist() == [2.0, 2.0]
    assert got[1].tolist() == pytest.approx([float(ce[0] + ce[1]), float(ce[2] + ce[3])],
                                            abs=1e-5)
    # By hand for position 0: only the 6 real logits enter the softmax.
    assert float(ce[0]) == pytest.approx(math.log(math.exp(4.0) + 5 * math.exp(-5.0)) - 4.0)
    names = ["passkey/depth_25", "passkey/depth_50", "mqar/dist_0-25"]
    sums = [1.0, 2.0, 0.0, 3.0, 1.0, 0.0, 2.0, 2.0, 0.0]
    m = probe_metrics(sums, names)
    assert m["probe/passkey_acc/depth_25"] == 0.5 and m["probe/passkey_acc/depth_50"] == 1.0
    assert m["probe/passkey_loss/depth_25"] == 1.5 and m["probe/passkey_acc"] == 0.75
    assert m["probe/passkey_loss"] == 1.0
    assert not any(k.startswith("probe/mqar") for k in m)  # an empty bucket is not reported


@pytest.mark.parametrize("cp", [1, 2])
def test_probe_microbatches_split_rows_over_dp_and_columns_over_cp(cp):
    settings = ProbeSettings(kinds=("passkey",), rows=1, seed=1, key_length=4)
    probes = build_probes(SPLIT, settings, 64, EOD)  # 5 rows
    dp, mbs = 2, 2
    seen = []
    for dp_rank in range(dp):
        for cp_rank in range(cp):
            mbs_ = probe_microbatches(probes, micro_batch_size=mbs, dp_size=dp,
                                      dp_rank=dp_rank, cp_size=cp, cp_rank=cp_rank, pp_size=1,
                                      eod_id=EOD, device=torch.device("cpu"))
            assert len(mbs_) == 2  # 5 rows padded to 8 = 2 microbatches x 2 rows x 2 DP ranks
            cols = load_balanced_indices(64, cp, cp_rank) if cp > 1 else torch.arange(64)
            for m, (mb, group) in enumerate(mbs_):
                assert mb.tokens.shape == (mbs, 64 // cp) and group.shape == (mbs, 64 // cp)
                assert (mb.packed_seq_ids == 1).all()  # one document per row
                for i in range(mbs):
                    row = (m * dp + dp_rank) * mbs + i
                    if row < probes.rows:
                        assert torch.equal(mb.labels[i], probes.labels[row, cols])
                        assert torch.equal(group[i], probes.group[row, cols])
                        seen.append((row, int((group[i] >= 0).sum())))
                    else:  # padding rows score nothing
                        assert (group[i] == -1).all()
    per_row: dict[int, int] = {}
    for row, n in seen:
        per_row[row] = per_row.get(row, 0) + n
    assert per_row == {r: 4 for r in range(5)}  # every key token scored once over the ranks


@pytest.mark.parametrize(("override", "message"), [
    ("train.eval_probes=[passkey,needle]", r"'train.eval_probes' = \['passkey', 'needle'\]"),
    ("train.eval_probes=[mqar,mqar]", "distinct probe names out of passkey, mqar"),
    ("train.eval_probe_markers=[1,256]", r"0 <= id < model.vocab_size \(256\)"),
    ("train.eval_probe_markers=[1,255]", r"end-of-document id \(255\)"),
    ("train.eval_probe_markers=[3]", r"two token ids: \[passkey marker, MQAR marker\]"),
    ("train.eval_probe_token_range=[0,70]", r"'train.eval_probe_token_range'.*holds \[1, 2\]"),
    ("train.eval_probe_token_range=[65,300]", "lo \\+ 2 <= hi <= model.vocab_size"),
    ("train.eval_probe_key_length=64", r"4 \* \(length \+ 1\) <= model.seq_length \(256\)"),
    ("train.eval_probe_mqar_pairs=13", "1 to 12 pairs for model.seq_length = 256"),
    ("train.eval_probe_rows=0", "'train.eval_probe_rows' = 0: expected a positive"),
    ("train.eval_probe_seed=-1", "'train.eval_probe_seed' = -1"),
])
def test_probe_keys_are_checked_at_recipe_load(override, message):
    base = SMALL + ["train.eval_interval=2", "train.eval_probes=[passkey,mqar]",
                    "train.eval_probe_mqar_pairs=4"]
    if "mqar_pairs" in override:
        base.pop()
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, [*base, override])


def test_probes_and_skip_train_need_evaluation():
    with pytest.raises(RecipeError, match="'train.eval_probes'.*set train.eval_interval"):
        load_recipe(None, [*SMALL, "train.eval_probes=[passkey]"])
    with pytest.raises(RecipeError, match="'train.skip_train' = True"):
        load_recipe(None, [*SMALL, "train.skip_train=true"])
    ok = load_recipe(None, [*SMALL, "train.eval_interval=2", "train.eval_probes=[mqar]",
                            "train.eval_probe_token_range=[48,58]"])
    settings = ProbeSettings.from_train(ok.train, ok.gpt.seq_length)
    # No MQAR pair count: 16, or as many as 256-token rows hold (12).
    assert settings.token_range == (48, 58) and settings.mqar_pairs == 12


def test_a_run_logs_probe_metrics_without_changing_training(tmp_path):
    common = ["train.train_iters=2", "train.eval_interval=2", "train.eval_iters=1",
              "model.msa_dense_warmup_steps=1"]
    probes = ["train.eval_probes=[passkey,mqar]", "train.eval_probe_rows=1",
              "train.eval_probe_mqar_pairs=4"]
    with_ = train([*common, *probes, f"logger.output_dir={tmp_path / 'p'}"])
    plain = train([*common, f"logger.output_dir={tmp_path / 'n'}"])
    row = json.loads((tmp_path / "p" / "metrics.jsonl").read_text().splitlines()[-1])
    for name, _, _ in PASSKEY_DEPTHS:
        assert 0.0 <= row[f"probe/passkey_acc/{name}"] <= 1.0
        # An untrained model over 256 tokens: the key's loss is near ln(256).
        assert abs(row[f"probe/passkey_loss/{name}"] - math.log(256)) < 1.0
    assert any(k.startswith("probe/mqar_acc/dist_") for k in row)
    assert 0.0 <= row["probe/mqar_acc"] <= 1.0
    # The probes read the model only: training and the validation loss are unchanged.
    assert [h["loss"] for h in with_["history"]] == [h["loss"] for h in plain["history"]]
    assert with_["val loss"] == plain["val loss"]
    assert "probe/passkey acc" in with_ and "probe/passkey acc/depth 50" not in with_
