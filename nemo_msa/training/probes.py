"""Retrieval probes of the evaluation: passkey and multi-query associative recall (MQAR).

The validation loss says how well a model predicts held-out text on average; it says little
about whether attention *finds* one far-away fact, which is what a block-sparse selection can
miss. The probes ask exactly that (issue #49, ADR 0040). Every probe row is ``S + 1`` tokens of
held-out text (the validation split's samples, end-of-document tokens and the probe markers
removed, so a row is one document that both MSA and dense attention see whole) with planted
tokens:

- **passkey**: ``marker key`` (``key``: ``train.eval_probe_key_length`` random tokens) at a depth
  of the row, and the same ``marker key`` at the row's end. The scored tokens are the key's
  tokens at the end (teacher-forced: the label of position ``j`` is the token at ``j + 1``), which
  only attention back to the planted key predicts. The depth is the key marker's position over
  the last position it can take (``S - 2 * key_length - 1``); ``train.eval_probe_rows`` rows per
  depth bucket: 0-10 % (uniform), 25 %, 50 %, 75 % and 90-100 % (uniform).
- **mqar**: ``train.eval_probe_mqar_pairs`` pairs ``marker key value`` (keys of
  :data:`MQAR_KEY_TOKENS` tokens, distinct within a row; values of :data:`MQAR_VALUE_TOKENS`)
  spread over the first three quarters of the row, then one query ``marker key value`` per pair,
  in a random order, spread over the last quarter. The scored tokens are the queries' values;
  the distance bucket is (query position - pair position) / S: 0-25 %, 25-50 %, 50-75 %,
  75-100 %.

Random draws come from ``numpy.random.default_rng(train.eval_probe_seed)`` in a fixed order and
the text from the validation split in its order, so every evaluation step and every run with the
same data, split, seed (``train.seed`` orders the split) and sequence length sees the same rows:
the arms of ``scripts/quality_bench.py`` are scored on identical probes. The probes are built
once, when the evaluator is made.

Scoring (:func:`score_positions`) takes the logits at the scored positions only (gathered over
tensor-parallel ranks, padded vocabulary entries excluded): accuracy is ``argmax == label`` and
the loss is the cross-entropy of the label, summed per bucket; the evaluator all-reduces the sums
and reports ``probe/<kind>_acc/<bucket>``, ``probe/<kind>_loss/<bucket>`` and the kind's overall
``probe/<kind>_acc`` / ``probe/<kind>_loss``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nemo_msa.training.recipe_fields import require

#: The probe kinds ``train.eval_probes`` may name.
PROBE_KINDS = ("passkey", "mqar")
#: Passkey depth buckets: (name, lowest depth, highest depth); equal ends mean that depth.
PASSKEY_DEPTHS: tuple[tuple[str, float, float], ...] = (
    ("depth_0-10", 0.0, 0.10), ("depth_25", 0.25, 0.25), ("depth_50", 0.50, 0.50),
    ("depth_75", 0.75, 0.75), ("depth_90-100", 0.90, 1.0))
#: MQAR distance buckets, in quarters of the sequence length.
MQAR_DISTANCES = ("dist_0-25", "dist_25-50", "dist_50-75", "dist_75-100")
#: Tokens of an MQAR key and of its value.
MQAR_KEY_TOKENS = 2
MQAR_VALUE_TOKENS = 2
#: Tokens of one MQAR pair (and of one query): marker, key, value.
MQAR_SPAN = 1 + MQAR_KEY_TOKENS + MQAR_VALUE_TOKENS


@dataclass(frozen=True)
class ProbeSettings:
    """The ``train.eval_probe*`` keys (see :class:`nemo_msa.training.recipe_schema.TrainConfig`).

    Attributes:
        kinds: probe kinds, a subset of :data:`PROBE_KINDS` in recipe order.
        rows: passkey rows per depth bucket, and MQAR rows.
        seed: the seed of every random draw.
        key_length: passkey key tokens.
        mqar_pairs: key-value pairs (and queries) per MQAR row.
        passkey_marker: the token that opens the planted key and the question.
        mqar_marker: the token that opens every MQAR pair and query.
        token_range: ``(lo, hi)``: key and value tokens are drawn from ``lo <= id < hi``.
    """

    kinds: tuple[str, ...]
    rows: int = 8
    seed: int = 0
    key_length: int = 8
    mqar_pairs: int = 16
    passkey_marker: int = 1
    mqar_marker: int = 2
    token_range: tuple[int, int] = (65, 91)

    @classmethod
    def from_train(cls, train, seq_length: int) -> ProbeSettings:
        """The settings of a recipe's ``train`` section (a TrainConfig) for rows of
        ``seq_length`` tokens (an unset MQAR pair count: :func:`default_mqar_pairs`)."""
        pairs = train.eval_probe_mqar_pairs
        return cls(kinds=tuple(train.eval_probes or ()), rows=train.eval_probe_rows,
                   seed=train.eval_probe_seed, key_length=train.eval_probe_key_length,
                   mqar_pairs=default_mqar_pairs(seq_length) if pairs is None else pairs,
                   passkey_marker=train.eval_probe_markers[0],
                   mqar_marker=train.eval_probe_markers[1],
                   token_range=(train.eval_probe_token_range[0], train.eval_probe_token_range[1]))

    @property
    def reserved(self) -> tuple[int, int]:
        """The marker tokens, removed from the held-out text."""
        return self.passkey_marker, self.mqar_marker


def check_probe_settings(train, seq_length: int, vocab_size: int, eod_id: int) -> None:
    """Validate the ``train.eval_probe*`` keys at recipe load.

    Args:
        train: the recipe's TrainConfig.
        seq_length: ``model.seq_length``.
        vocab_size: ``model.vocab_size``.
        eod_id: the end-of-document token id.

    Raises:
        RecipeError: naming the key, its value and what was expected.
    """
    kinds = list(train.eval_probes or [])
    if not kinds:
        return
    bad = [k for k in kinds if k not in PROBE_KINDS]
    require(not bad and len(set(kinds)) == len(kinds), "train.eval_probes", kinds,
            f"a list of distinct probe names out of {', '.join(PROBE_KINDS)}")
    require(train.eval_interval is not None, "train.eval_probes", kinds,
            "an empty list without evaluation (set train.eval_interval: the probes run with it)")
    require(train.eval_probe_rows > 0, "train.eval_probe_rows", train.eval_probe_rows,
            "a positive number of rows")
    markers = list(train.eval_probe_markers)
    require(len(markers) == 2, "train.eval_probe_markers", markers,
            "two token ids: [passkey marker, MQAR marker]")
    require(all(0 <= m < vocab_size for m in markers) and markers[0] != markers[1]
            and eod_id not in markers, "train.eval_probe_markers", markers,
            f"two distinct token ids, 0 <= id < model.vocab_size ({vocab_size}), neither the "
            f"end-of-document id ({eod_id})")
    span = list(train.eval_probe_token_range)
    require(len(span) == 2 and 0 <= span[0] and span[0] + 2 <= span[1] <= vocab_size,
            "train.eval_probe_token_range", span,
            f"[lo, hi] with 0 <= lo, lo + 2 <= hi <= model.vocab_size ({vocab_size}): key and "
            "value tokens are drawn from lo <= id < hi")
    inside = [t for t in (*markers, eod_id) if span[0] <= t < span[1]]
    require(not inside, "train.eval_probe_token_range", span,
            f"a range that holds neither marker nor the end-of-document id (holds {inside})")
    if "passkey" in kinds:
        k = train.eval_probe_key_length
        require(k > 0 and 4 * (k + 1) <= seq_length, "train.eval_probe_key_length", k,
                f"a positive length with 4 * (length + 1) <= model.seq_length ({seq_length})")
    if "mqar" in kinds:
        require(seq_length >= 4 * MQAR_SPAN, "train.eval_probes", kinds,
                f"no 'mqar' for model.seq_length = {seq_length} (a row holds one pair from "
                f"{4 * MQAR_SPAN} tokens on)")
    if "mqar" in kinds and train.eval_probe_mqar_pairs is not None:
        pairs, most = train.eval_probe_mqar_pairs, mqar_max_pairs(seq_length)
        n_keys = (span[1] - span[0]) ** MQAR_KEY_TOKENS
        require(0 < pairs <= min(most, n_keys), "train.eval_probe_mqar_pairs", pairs,
                f"1 to {min(most, n_keys)} pairs for model.seq_length = {seq_length} (each pair "
                f"and its query take {MQAR_SPAN} tokens, the queries the last quarter of the "
                f"row; distinct keys of {MQAR_KEY_TOKENS} tokens from the token range)")


def mqar_max_pairs(seq_length: int) -> int:
    """The most MQAR pairs a row of ``seq_length`` tokens holds (queries in its last quarter)."""
    return (seq_length // 4) // MQAR_SPAN


def default_mqar_pairs(seq_length: int) -> int:
    """MQAR pairs when ``train.eval_probe_mqar_pairs`` is null: 16, or as many as fit."""
    return max(1, min(16, mqar_max_pairs(seq_length)))


@dataclass
class ProbeSet:
    """The probe rows, built once.

    Attributes:
        tokens: int64 ``[N, S]`` input tokens.
        labels: int64 ``[N, S]`` next tokens.
        group: int64 ``[N, S]``: the bucket (index into ``names``) of each scored label, -1
            where nothing is scored.
        names: ``kind/bucket`` per bucket, e.g. ``passkey/depth_50``, ``mqar/dist_0-25``.
        planted: per row, ``(kind, [(position, distance_or_depth), ...])`` of its planted items
            (for tests and reports): passkey ``[(needle position, depth)]``; MQAR per pair
            ``(pair position, query position)``.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    group: torch.Tensor
    names: list[str]
    planted: list[tuple[str, list[tuple[int, float]]]]

    @property
    def rows(self) -> int:
        """N, the number of probe rows."""
        return int(self.tokens.shape[0])


def probe_names(kinds: Sequence[str]) -> list[str]:
    """``kind/bucket`` of every bucket of ``kinds``, in :data:`PROBE_KINDS` order."""
    names = []
    if "passkey" in kinds:
        names += [f"passkey/{name}" for name, _, _ in PASSKEY_DEPTHS]
    if "mqar" in kinds:
        names += [f"mqar/{name}" for name in MQAR_DISTANCES]
    return names


class _Haystack:
    """Held-out text in dataset order without the banned tokens, one row's worth at a time."""

    def __init__(self, dataset, banned: Sequence[int]):
        self.dataset, self.banned = dataset, np.asarray(sorted(set(banned)), dtype=np.int64)
        self.cursor = 0

    def take(self, length: int) -> np.ndarray:
        """The next ``length`` tokens (int64); samples are read in order, wrapping around."""
        parts, have, misses = [], 0, 0
        while have < length:
            sample = self.dataset[self.cursor % len(self.dataset)]
            self.cursor += 1
            tokens = np.asarray(sample["tokens"], dtype=np.int64)
            tokens = tokens[~np.isin(tokens, self.banned)]
            misses = misses + 1 if tokens.size == 0 else 0
            if misses > len(self.dataset):
                raise ValueError("the validation split holds no tokens besides the end-of-"
                                 f"document and probe marker tokens {self.banned.tolist()}")
            parts.append(tokens)
            have += tokens.size
        return np.concatenate(parts)[:length]


def _passkey_row(row: np.ndarray, rng: np.random.Generator, s: ProbeSettings, lo: float,
                 hi: float) -> tuple[list[int], int, float]:
    """Plant a passkey into ``row`` ([S + 1] int64, in place).

    Returns:
        The label positions scored (the question's key tokens), the needle's position and its
        depth.
    """
    length, k = row.size, s.key_length
    key = rng.integers(s.token_range[0], s.token_range[1], size=k)
    depth = float(rng.uniform(lo, hi)) if hi > lo else lo
    last = length - 2 * k - 2  # the needle ends before the question's marker
    pos = int(np.floor(depth * last + 0.5))
    question = length - 1 - k
    row[pos], row[pos + 1:pos + 1 + k] = s.passkey_marker, key
    row[question], row[question + 1:] = s.passkey_marker, key
    # Label j is token j + 1: the key tokens of the question are labels question .. length - 2.
    return list(range(question, length - 1)), pos, pos / last


def _mqar_row(row: np.ndarray, rng: np.random.Generator, s: ProbeSettings
              ) -> list[tuple[list[int], int, int]]:
    """Plant MQAR pairs and queries into ``row`` ([S + 1] int64, in place).

    Returns:
        Per pair: the label positions scored (its query's value tokens), the pair's position
        and its query's position.
    """
    length, n = row.size, s.mqar_pairs
    seq = length - 1
    first_query = seq - seq // 4  # the queries fill the last quarter of the row (and one more)
    width = s.token_range[1] - s.token_range[0]
    codes = rng.choice(width ** MQAR_KEY_TOKENS, size=n, replace=False)
    keys = [[s.token_range[0] + int(c) // width ** i % width for i in range(MQAR_KEY_TOKENS)]
            for c in codes]
    values = rng.integers(s.token_range[0], s.token_range[1], size=(n, MQAR_VALUE_TOKENS))
    pair_slot, query_slot = first_query // n, (length - first_query) // n
    pairs = [i * pair_slot + int(rng.integers(0, pair_slot - MQAR_SPAN + 1)) for i in range(n)]
    order = rng.permutation(n)
    out = []
    for i in range(n):
        p = pairs[i]
        row[p], row[p + 1:p + MQAR_SPAN] = s.mqar_marker, [*keys[i], *values[i]]
    for slot, i in enumerate(order):
        q = first_query + slot * query_slot + int(rng.integers(0, query_slot - MQAR_SPAN + 1))
        row[q], row[q + 1:q + MQAR_SPAN] = s.mqar_marker, [*keys[i], *values[i]]
        scored = list(range(q + MQAR_KEY_TOKENS, q + MQAR_KEY_TOKENS + MQAR_VALUE_TOKENS))
        out.append((scored, pairs[i], q))
    return out


def distance_bucket(distance: int, seq_length: int) -> int:
    """The MQAR distance bucket (index into :data:`MQAR_DISTANCES`) of a query-pair distance."""
    return min(4 * distance // seq_length, len(MQAR_DISTANCES) - 1)


def build_probes(dataset, settings: ProbeSettings, seq_length: int, eod_id: int) -> ProbeSet:
    """Build the probe rows from held-out samples (deterministic; see the module docstring).

    Args:
        dataset: the validation split, indexable, ``len`` > 0; ``dataset[i]["tokens"]`` a 1-D
            int tensor or array (Megatron's GPTDataset items).
        settings: the probe settings.
        seq_length: S, tokens per row.
        eod_id: the end-of-document token, removed from the text with the markers.

    Returns:
        The :class:`ProbeSet`: passkey rows (``settings.rows`` per depth bucket, buckets in
        order) then MQAR rows.
    """
    rng = np.random.default_rng(settings.seed)
    hay = _Haystack(dataset, (eod_id, *settings.reserved))
    names = probe_names(settings.kinds)
    rows, groups, planted = [], [], []
    if "passkey" in settings.kinds:
        for b, (_, lo, hi) in enumerate(PASSKEY_DEPTHS):
            for _ in range(settings.rows):
                row = hay.take(seq_length + 1)
                scored, pos, depth = _passkey_row(row, rng, settings, lo, hi)
                group = np.full(seq_length, -1, dtype=np.int64)
                group[scored] = names.index(f"passkey/{PASSKEY_DEPTHS[b][0]}")
                rows.append(row), groups.append(group)
                planted.append(("passkey", [(pos, depth)]))
    if "mqar" in settings.kinds:
        for _ in range(settings.rows):
            row = hay.take(seq_length + 1)
            group = np.full(seq_length, -1, dtype=np.int64)
            items = []
            for scored, p, q in _mqar_row(row, rng, settings):
                bucket = distance_bucket(q - p, seq_length)
                group[scored] = names.index(f"mqar/{MQAR_DISTANCES[bucket]}")
                items.append((p, float(q)))
            rows.append(row), groups.append(group)
            planted.append(("mqar", items))
    full = torch.from_numpy(np.stack(rows))
    return ProbeSet(full[:, :-1].contiguous(), full[:, 1:].contiguous(),
                    torch.from_numpy(np.stack(groups)), names, planted)


def score_positions(logits: torch.Tensor, labels: torch.Tensor, group: torch.Tensor,
                    num_groups: int, vocab_size: int) -> torch.Tensor:
    """Per-bucket correct predictions, loss sum and count of scored positions.

    Args:
        logits: ``[n, V]`` (any float dtype) at the scored positions over the whole (padded)
            vocabulary; entries at ``vocab_size`` and above (padding) are ignored.
        labels: int64 ``[n]``, the tokens to predict.
        group: int64 ``[n]``, each position's bucket, ``0 <= group < num_groups``.
        num_groups: G.
        vocab_size: the real vocabulary size.

    Returns:
        float64 ``[3, G]``: rows are the number of positions with ``argmax == label``, the sum
        of the cross-entropy of the label, and the number of positions.
    """
    out = torch.zeros(3, num_groups, dtype=torch.float64, device=logits.device)
    if logits.shape[0] == 0:
        return out
    x = logits.float()[:, :vocab_size]
    correct = (x.argmax(dim=-1) == labels).double()
    loss = torch.nn.functional.cross_entropy(x, labels, reduction="none").double()
    out[0].scatter_add_(0, group, correct)
    out[1].scatter_add_(0, group, loss)
    out[2].scatter_add_(0, group, torch.ones_like(loss))
    return out


def probe_metrics(sums: Sequence[float], names: Sequence[str]) -> dict[str, float]:
    """The metrics from the all-reduced ``[3, G]`` sums (flattened, row-major).

    Returns:
        ``probe/<kind>_acc/<bucket>`` and ``probe/<kind>_loss/<bucket>`` per non-empty bucket
        and ``probe/<kind>_acc`` / ``probe/<kind>_loss`` over each kind's buckets.
    """
    g = len(names)
    correct, loss, count = sums[:g], sums[g:2 * g], sums[2 * g:3 * g]
    out: dict[str, float] = {}
    totals: dict[str, list[float]] = {}
    for name, c, lo, n in zip(names, correct, loss, count, strict=True):
        kind, bucket = name.split("/", 1)
        if n > 0:
            out[f"probe/{kind}_acc/{bucket}"] = c / n
            out[f"probe/{kind}_loss/{bucket}"] = lo / n
        t = totals.setdefault(kind, [0.0, 0.0, 0.0])
        t[0], t[1], t[2] = t[0] + c, t[1] + lo, t[2] + n
    for kind, (c, lo, n) in totals.items():
        if n > 0:
            out[f"probe/{kind}_acc"] = c / n
            out[f"probe/{kind}_loss"] = lo / n
    return out


__all__ = ["MQAR_DISTANCES", "MQAR_KEY_TOKENS", "MQAR_SPAN", "MQAR_VALUE_TOKENS",
           "PASSKEY_DEPTHS", "PROBE_KINDS", "ProbeSet", "ProbeSettings", "build_probes",
           "check_probe_settings", "default_mqar_pairs", "distance_bucket", "mqar_max_pairs",
           "probe_metrics", "probe_names", "score_positions"]
