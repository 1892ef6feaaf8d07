"""Data: Megatron GPT datasets -> packed microbatches that carry ``packed_seq_ids``.

Megatron's GPTDataset already packs documents into fixed-length samples (a sample spans
document boundaries; every document ends with the EOD token). What MSA needs on top is the
document map of each sample, so that block selection and attention stay inside a document:
``packed_seq_ids`` int64 [batch, seq], 1, 2, 3, ... per document in each row (a new document
starts after every EOD token) and 0 on padding. Positions restart per document
(``reset_position_ids``), as the model would see each document on its own.

With ``dataset.packed_format: thd`` the microbatch also carries Megatron's ``PackedSeqParams``
(:func:`thd_packed_seq_params`): the rows laid end to end as one sequence of packed documents,
``cu_seqlens`` at the same EOD boundaries, which the model takes as THD input ([1, b * S]
tokens, ``attention_mask`` None) instead of the document ids (ADR 0052).

Every microbatch is built once and moved to the device once (:func:`collate`); the loop hands the
*same* objects to every virtual-pipeline chunk through
``nemo_msa.megatron.microbatch.SharedMicrobatchIterators``: the MSA layout memo keys on the
identity of ``packed_seq_ids`` (THD: of ``cu_seqlens``), so one layout (and one device-to-host
sync) serves all chunks.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType
from megatron.core.packed_seq_params import PackedSeqParams

from nemo_msa.context_parallel import split_for_context_parallel
from nemo_msa.training.indexed_files import check_indexed_files
from nemo_msa.training.recipe_fields import RecipeError
from nemo_msa.training.recipe_schema import PACKED_FORMATS, DatasetConfig, GPTModelArgs

logger = logging.getLogger(__name__)


def packed_seq_ids_from_tokens(tokens: torch.Tensor, eod_id: int,
                               padding: torch.Tensor | None = None) -> torch.Tensor:
    """Derive the document map of packed rows.

    Args:
        tokens: int [batch, seq] token ids.
        eod_id: the end-of-document token; it is the last token of its document.
        padding: optional bool [batch, seq], True on padding positions (a suffix of each row).

    Returns:
        int64 [batch, seq]: 1 + the number of EOD tokens strictly before each position, 0 on
        padding.
    """
    is_eod = (tokens == eod_id).to(torch.int64)
    # A document starts after every EOD, so the id of position i counts the EODs before i.
    ids = torch.cumsum(is_eod, dim=-1) - is_eod + 1
    if padding is not None:
        ids = ids.masked_fill(padding, 0)
    return ids


def positions_from_document_ids(ids: torch.Tensor) -> torch.Tensor:
    """Document-local positions (0, 1, 2, ... restarting at every document; 0 on padding)."""
    seq = ids.shape[-1]
    arange = torch.arange(seq, device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    # The start index of each position's document is the running max of start indices.
    start_idx = torch.where(starts, arange, torch.zeros_like(arange))
    start_idx = torch.cummax(start_idx, dim=-1).values
    return (arange - start_idx).masked_fill(ids == 0, 0)


def thd_packed_seq_params(packed_seq_ids: torch.Tensor) -> PackedSeqParams:
    """Megatron's THD ``PackedSeqParams`` of a microbatch whose rows are laid end to end.

    Every document of the document map (a new one after each EOD, and at each row start) is one
    packed sequence; padding (id 0, a suffix of its row) belongs to the sequence before it as
    ``cu_seqlens_q_padded`` says (TE's convention), or to an empty sequence of its own when
    nothing precedes it (a first row that is all padding).

    Args:
        packed_seq_ids: int [b, S] document ids (:func:`packed_seq_ids_from_tokens`), on the
            host (the lengths are read there, no device sync).

    Returns:
        ``PackedSeqParams(qkv_format="thd")`` with int32 ``cu_seqlens_q`` (= ``cu_seqlens_kv``,
        the same tensor) of the real lengths, ``cu_seqlens_q_padded`` (= ``..._kv_padded``)
        of the starts in the [b * S] pack (None when there is no padding), and
        ``max_seqlen_q`` = ``max_seqlen_kv`` the longest padded sequence (host ints).
    """
    flat = packed_seq_ids.reshape(-1).long()
    total, seq = flat.numel(), packed_seq_ids.shape[-1]
    real = flat > 0
    # One key per (row, document): a document never continues across a row end.
    key = torch.where(real, torch.arange(total) // seq * (seq + 1) + flat, -1)
    start = real & (key != torch.cat([key.new_full((1,), -2), key[:-1]]))
    starts = start.nonzero().flatten()
    lengths = torch.bincount((torch.cumsum(start.long(), 0) - 1)[real],
                             minlength=starts.numel())
    if total and not bool(real[0]):
        starts = torch.cat([starts.new_zeros(1), starts])
        lengths = torch.cat([lengths.new_zeros(1), lengths])
    padded = torch.cat([starts, starts.new_full((1,), total)]).to(torch.int32)
    cu = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    cu_padded = None if torch.equal(cu, padded) else padded
    longest = int((padded[1:] - padded[:-1]).max()) if total else 0
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def schedule_shape(seq_length: int, micro_batch_size: int, packed_format: str) -> tuple[int, int]:
    """``(seq_length, micro_batch_size)`` of a microbatch's activations as Megatron's pipeline
    schedules send them between stages: [S, b, h], or [b * S, 1, h] for THD input."""
    if packed_format == "thd":
        return seq_length * micro_batch_size, 1
    return seq_length, micro_batch_size


class _Tokenizer:
    """The minimal tokenizer interface Megatron's GPT datasets read (no text processing).

    Pre-tokenized indexed data and the mock data need only the vocabulary size and the EOD id;
    a pad id of -1 lets Megatron use its own sentinel for the padding it inserts.
    """

    def __init__(self, vocab_size: int, eod_id: int) -> None:
        self.vocab_size = vocab_size
        self.eod = eod_id
        self.eos = eod_id

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        """What Megatron hashes into the dataset cache key."""
        return {"class": "nemo_msa.training.data._Tokenizer", "vocab_size": self.vocab_size,
                "eod": self.eod}


def _check_prefixes(prefixes: list[str]) -> None:
    for prefix in prefixes:
        missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
        if missing:
            raise RecipeError(
                f"recipe key 'dataset.data_path': dataset prefix {prefix!r} has no "
                f"{' and no '.join(prefix + ext for ext in missing)} (expected the .bin/.idx pair "
                "written by Megatron's IndexedDatasetBuilder / preprocess_data.py)"
            )


_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def parse_data_path(value: Any) -> tuple[list[str], list[float] | None] | None:
    """Parse ``dataset.data_path`` into prefixes and optional weights, as Megatron's blend.

    Accepted: null or an empty list (mock data); a list of prefixes; a flat list of weight,
    prefix pairs ``[w1, p1, w2, p2, ...]``; or the same as one string separated by spaces or
    commas (as on Megatron's command line).

    Returns:
        ``(prefixes, weights)`` (weights None when unweighted), or None for mock data.

    Raises:
        RecipeError: a list that mixes weights and prefixes other than in pairs (e.g. a missing
            prefix or weight, or a misspelt weight), a negative weight or all weights zero.
    """
    if value is None:
        return None
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    if not items:
        return None
    texts = [str(x).strip() for x in items]
    # A number is a weight unless a dataset of that name exists (a prefix such as '2023').
    is_weight = [(isinstance(x, (int, float)) and not isinstance(x, bool)
                  or bool(_NUMBER.fullmatch(t))) and not Path(t + ".bin").is_file()
                 for x, t in zip(items, texts, strict=True)]
    key = "recipe key 'dataset.data_path'"
    if not any(is_weight):
        return texts, None
    pairs = len(texts) % 2 == 0 and all(is_weight[0::2]) and not any(is_weight[1::2])
    if not pairs:
        wrong = [j for j in range(len(texts)) if is_weight[j] != (j % 2 == 0)]
        if wrong:
            i = wrong[0]
            what = ("a weight where a dataset prefix belongs" if is_weight[i]
                    else "not a number where a weight belongs")
        else:
            i, what = len(texts) - 1, "a weight with no prefix after it"
        t = texts[i]
        raise RecipeError(
            f"{key} = {value!r}: item {i + 1} ({t!r}) is {what}; expected dataset prefixes "
            "[prefix1, prefix2, ...] or weight, prefix pairs [w1, prefix1, w2, prefix2, ...]"
        )
    weights = [float(t) for t in texts[0::2]]
    if any(w < 0 for w in weights) or not sum(weights) > 0:
        raise RecipeError(f"{key} = {value!r}: expected non-negative weights, not all zero")
    return texts[1::2], weights


def _bin_dtype(prefix: str):
    """The token dtype recorded in a Megatron ``.idx`` header."""
    with open(prefix + ".idx", "rb") as fh:
        header = fh.read(18)
    if len(header) < 18:
        raise RecipeError(f"recipe key 'dataset.data_path': {prefix}.idx is too short to be a "
                          "Megatron index file (expected the output of preprocess_data.py)")
    # 9 bytes of magic, 8 of version, then one byte of dtype code.
    return DType.dtype_from_code(header[17])


def check_token_range(prefix: str, vocab_size: int, chunk_tokens: int = 1 << 26) -> int:
    """Check that every token id of an indexed dataset lies in ``0 <= id < vocab_size``.

    Skipped when the file's dtype cannot hold an id outside the vocabulary (uint16 data with a
    vocabulary of at least 65536). Otherwise the ``.bin`` file is scanned once through a memory
    map, 64 Mi tokens at a time (max and min): about 7 GB/s from the page cache on one core of
    the CPU machine, else the disk's read rate, once per rank when the dataset is opened.

    Returns:
        The largest token id found (the dtype's maximum when the scan was skipped).

    Raises:
        RecipeError: naming the prefix, the largest (or a negative) id and model.vocab_size.
    """
    dtype = np.dtype(_bin_dtype(prefix))
    if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
        return int(np.iinfo(dtype).max)
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    high, low = -1, 0
    for start in range(0, len(tokens), chunk_tokens):
        part = tokens[start:start + chunk_tokens]
        high = max(high, int(part.max()))
        low = min(low, int(part.min()))
    del tokens
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise RecipeError(
            f"recipe key 'model.vocab_size' = {vocab_size}: dataset {prefix}.bin holds token id "
            f"{bad}, outside 0 <= id < model.vocab_size (expected a vocabulary at least "
            f"{high + 1} large for this data, or data tokenized for this vocabulary)"
        )
    return high


def eod_token_id(dataset: DatasetConfig, gpt: GPTModelArgs) -> int:
    """The EOD id: dataset.eod_id, or vocab_size - 1 (the NullTokenizer convention)."""
    return int(dataset.eod_id) if dataset.eod_id is not None else gpt.vocab_size - 1


def build_train_dataset(dataset: DatasetConfig, gpt: GPTModelArgs, seed: int, num_samples: int):
    """Build the training split with BlendedMegatronDatasetBuilder.

    Args:
        dataset: the recipe's dataset section.
        gpt: model arguments (vocab size and sequence length).
        seed: dataset shuffling seed.
        num_samples: samples the run consumes (train_iters * global_batch_size).

    Returns:
        A Megatron dataset whose items are dicts with tokens, labels, loss_mask, position_ids.

    Raises:
        RecipeError: a malformed weight list, a dataset prefix whose .bin/.idx files do not
            exist or are damaged, truncated or empty (:func:`check_indexed_files`), or token
            ids outside the vocabulary.
    """
    return build_gpt_datasets(dataset, gpt, seed, num_samples, 0)[0]


def build_gpt_datasets(dataset: DatasetConfig, gpt: GPTModelArgs, seed: int, num_samples: int,
                       num_valid_samples: int):
    """Build the training and validation splits of ``dataset.split`` in one builder call.

    Args:
        dataset, gpt, seed, num_samples: as :func:`build_train_dataset`.
        num_valid_samples: validation samples to draw; 0 builds no validation split.

    Returns:
        ``(train, valid)``; ``valid`` is None when not asked for or when the split gives the
        validation share no documents.

    Raises:
        RecipeError: as :func:`build_train_dataset`.
    """
    blend = parse_data_path(dataset.data_path)
    if blend is not None:
        _check_prefixes(blend[0])
        for prefix in blend[0]:
            # Megatron's reader trusts the files; a damaged one would fail naming nothing.
            check_indexed_files(prefix)
            check_token_range(prefix, gpt.vocab_size)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=gpt.seq_length,
        blend=blend,
        split=dataset.split,
        path_to_cache=dataset.path_to_cache,
        mmap_bin_files=dataset.mmap_bin_files,
        tokenizer=_Tokenizer(gpt.vocab_size, eod_token_id(dataset, gpt)),
        reset_position_ids=dataset.reset_position_ids,
        reset_attention_mask=False,
        eod_mask_loss=dataset.eod_mask_loss,
        # MSA derives its masks from packed_seq_ids; an [s, s] mask per sample is wasted memory.
        create_attention_mask=False,
    )
    cls = MockGPTDataset if blend is None else GPTDataset
    if blend is None:
        eod = eod_token_id(dataset, gpt)
        # Megatron's mock documents count up modulo the tokenizer's vocabulary and end with its
        # EOD; with EOD = vocab - 1 the count would hit the EOD id every vocab tokens and split
        # one mock document into many. Counting modulo the EOD id keeps EOD for document ends.
        config.tokenizer = _Tokenizer(eod if eod == gpt.vocab_size - 1 else gpt.vocab_size, eod)
    sizes = [num_samples, num_valid_samples or None, None]
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    if train is None:
        raise RecipeError(
            f"recipe key 'dataset.split' = {dataset.split!r}: the training split is empty "
            "(expected a non-zero first weight, e.g. '99,1,0')"
        )
    return train, (valid if num_valid_samples else None)


@dataclass
class Microbatch:
    """One microbatch on the device; the same object is handed to every pipeline chunk.

    Under context parallelism (CP = N > 1) ``tokens``, ``labels``, ``loss_mask`` and
    ``position_ids`` hold this rank's share [b, S / N] in Megatron's load-balanced order
    (:func:`split_microbatch`), while ``packed_seq_ids`` stays the *global* document
    map [b, S] that every CP rank shares (the MSA layers take the global map and know their
    local queries from the CP rank).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_ids: torch.Tensor
    #: fp32 scalar: loss-mask sum of the whole (global) microbatch, the same on every CP rank.
    loss_tokens: torch.Tensor | None = None
    #: The context-parallel size the tensors above were split for.
    cp_size: int = 1
    #: THD input (``dataset.packed_format: thd``): the rows end to end, cu_seqlens on the
    #: device; None for the document-id (BSHD) path.
    packed_seq_params: PackedSeqParams | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens of this rank's share (real and padding), for throughput."""
        return int(self.tokens.numel())


def split_microbatch(mb: Microbatch, cp_size: int, cp_rank: int) -> Microbatch:
    """This CP rank's share of a global microbatch (done once per microbatch, on the host).

    Tokens, labels, loss mask and position ids keep the columns of Megatron's load-balanced
    split (``nemo_msa.context_parallel.load_balanced_indices``: 2N chunks, rank r keeps chunks
    r and 2N-1-r, as ``megatron.core.utils.get_batch_on_this_cp_rank``); the document map stays
    global. ``loss_tokens`` is the loss-mask sum of the global microbatch, which the loss
    divides by so that the CP ranks' shares add up to the CP = 1 loss.

    Args:
        mb: the global microbatch, tensors [b, S] (S a multiple of 2 * cp_size).
        cp_size: N; 1 returns the same tensors with ``loss_tokens`` set.
        cp_rank: this rank's index in the CP group.

    Returns:
        A Microbatch with [b, S / N] tensors (``packed_seq_ids`` [b, S]).

    Raises:
        ValueError: S not a multiple of ``2 * cp_size``, or a bad size or rank.
    """
    loss_tokens = mb.loss_mask.sum(dtype=torch.float32)

    def take(x: torch.Tensor) -> torch.Tensor:
        return split_for_context_parallel(x, 1, cp_size, cp_rank)

    return Microbatch(take(mb.tokens), take(mb.labels), take(mb.loss_mask),
                      take(mb.position_ids), mb.packed_seq_ids, loss_tokens, cp_size)


def collate(samples: list[dict[str, torch.Tensor]], eod_id: int, device: torch.device,
            reset_position_ids: bool = True, cp_size: int = 1, cp_rank: int = 0,
            packed_format: str = "bshd") -> Microbatch:
    """Stack dataset samples and derive the document map; one host-to-device copy per tensor.

    Megatron pads the last samples of a split with a pad id that it then rewrites to token 0
    with label 0 and loss 0; such a tail (token 0, label 0, loss 0 up to the row end) becomes
    padding (document id 0). With ``cp_size > 1`` the document map and positions are derived
    from the whole rows, then the rows are split for this CP rank
    (:func:`split_microbatch`) before the copy to the device. With ``packed_format="thd"`` the
    microbatch also gets the THD ``PackedSeqParams`` of the same document map
    (:func:`thd_packed_seq_params`).

    Raises:
        ValueError: an unknown ``packed_format``, or THD with ``cp_size > 1`` (the recipe
            refuses it first).
    """
    if packed_format not in PACKED_FORMATS:
        raise ValueError(f"packed_format={packed_format!r}; expected one of {PACKED_FORMATS}")
    if packed_format == "thd" and cp_size > 1:
        raise ValueError("packed_format='thd' with cp_size > 1: the THD data path does not "
                         "split documents for context parallelism")
    tokens = torch.stack([s["tokens"] for s in samples]).long()
    labels = torch.stack([s["labels"] for s in samples]).long()
    loss_mask = torch.stack([s["loss_mask"] for s in samples]).float()
    dead = (tokens == 0) & (labels == 0) & (loss_mask == 0)
    # Padding is only a suffix: a position is padding if it and everything after it is dead.
    padding = torch.flip(torch.cummin(torch.flip(dead.int(), [-1]), dim=-1).values, [-1]).bool()
    ids = packed_seq_ids_from_tokens(tokens, eod_id, padding)
    if reset_position_ids:
        positions = positions_from_document_ids(ids)
    else:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
    host = split_microbatch(Microbatch(tokens, labels, loss_mask, positions, ids), cp_size,
                            cp_rank)
    nb = device.type != "cpu"
    params = None
    if packed_format == "thd":
        params = thd_packed_seq_params(ids)
        cu = params.cu_seqlens_q.to(device, non_blocking=nb)
        padded = params.cu_seqlens_q_padded
        padded = padded.to(device, non_blocking=nb) if padded is not None else None
        # One tensor object for q and kv: the layers memoize the layout on it.
        params.cu_seqlens_q = params.cu_seqlens_kv = cu
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = padded
    return Microbatch(
        tokens=host.tokens.to(device, non_blocking=nb),
        labels=host.labels.to(device, non_blocking=nb),
        loss_mask=host.loss_mask.to(device, non_blocking=nb),
        position_ids=host.position_ids.to(device, non_blocking=nb),
        packed_seq_ids=host.packed_seq_ids.to(device, non_blocking=nb),
        loss_tokens=host.loss_tokens.to(device, non_blocking=nb),
        cp_size=cp_size,
        packed_seq_params=params,
    )


class MicrobatchSource:
    """Deterministic, resumable stream of this data-parallel rank's microbatches.

    Sample order follows Megatron's pretraining sampler: global batch g of the run covers samples
    [g * gbs, (g + 1) * gbs); inside it, microbatch m of data-parallel rank r takes
    ``mbs`` consecutive samples at ``g * gbs + (m * dp + r) * mbs``. The position is just
    ``consumed_samples``, which the checkpoint stores. The ranks of one context-parallel group
    read the same samples and keep their own share of each row (``cp_size``, ``cp_rank``).
    ``packed_format`` is :func:`collate`'s.
    """

    def __init__(self, dataset, *, micro_batch_size: int, global_batch_size: int, dp_size: int,
                 dp_rank: int, eod_id: int, device: torch.device, consumed_samples: int = 0,
                 reset_position_ids: bool = True, cp_size: int = 1, cp_rank: int = 0,
                 packed_format: str = "bshd"):
        self.dataset = dataset
        self.mbs = micro_batch_size
        self.gbs = global_batch_size
        self.dp = dp_size
        self.dp_rank = dp_rank
        self.eod_id = eod_id
        self.device = device
        self.consumed_samples = consumed_samples
        self.reset_position_ids = reset_position_ids
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.packed_format = packed_format

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on this rank."""
        return self.gbs // (self.mbs * self.dp)

    def step_microbatches(self) -> list[Microbatch] | None:
        """Return the next step's microbatches, or None for ranks that need no data.

        Advances ``consumed_samples`` by one global batch.
        """
        base = self.consumed_samples
        out = []
        for m in range(self.num_microbatches):
            start = base + (m * self.dp + self.dp_rank) * self.mbs
            samples = [self.dataset[(start + i) % len(self.dataset)] for i in range(self.mbs)]
            out.append(collate(samples, self.eod_id, self.device, self.reset_position_ids,
                               self.cp_size, self.cp_rank, self.packed_format))
        self.consumed_samples += self.gbs
        return out
