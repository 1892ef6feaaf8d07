"""Document-map recovery from what a packed batch carries.

The document map is int64 [batch, sequence]: 0 marks padding and every positive id is one
contiguous run of tokens inside its row. It is recovered from the first source present, in the
order of the contract (MSA_SPEC.md, "Layout"):

1. ``packed_seq_ids`` [b, s] (integer): the loader's document ids.
2. a 2-D ``attention_mask`` [b, s] holding integer document ids.
3. a bool 4-D block-causal ``attention_mask`` [b, 1, s, s]; query row i keeps key j where True.
4. a bool ``padding_mask`` [b, s]; Megatron's convention: True marks padding.
5. nothing: one document per row.

Everything here runs on the tensors' device without a host synchronization. Validation is folded
into a small "report" tensor that the layout builder copies to the host once, together with the
sizes it needs (see :func:`summarize_document_map`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT32_MAX = 2**31 - 1

# Sentinel for "no bad row" in the device-side report; larger than any row index we accept.
_NO_BAD_ROW = INT32_MAX


@dataclass(frozen=True)
class DocumentMapSource:
    """Which input the document map came from.

    Attributes:
        name: one of ``packed_seq_ids``, ``attention_mask_2d``, ``attention_mask_4d``,
            ``padding_mask``, ``none``.
        tensor: the source tensor (``None`` for ``none``); the layout memo keys on its identity.
    """

    name: str
    tensor: torch.Tensor | None


def select_document_map_source(
    packed_seq_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
) -> DocumentMapSource:
    """Picks the first document-map source present, in the contract's priority order.

    Args:
        packed_seq_ids: optional int [b, s] document ids (0 = padding).
        attention_mask: optional 2-D [b, s] document ids or bool 4-D [b, 1, s, s] block-causal
            mask (True = query row keeps key column).
        padding_mask: optional bool [b, s], True marks padding (Megatron's convention).

    Returns:
        The chosen source.

    Raises:
        ValueError: when the chosen source has the wrong rank or dtype, or is on the meta device.
    """
    if packed_seq_ids is not None:
        if packed_seq_ids.dtype == torch.bool:
            # A bool tensor is a mask, and masks come in both polarities (Megatron's padding
            # mask is True = padding, HF's attention mask True = keep): never guess.
            raise ValueError(
                "packed_seq_ids must hold integer document ids (0 = padding, 1, 2, ... one per "
                f"document); got a bool tensor of shape {tuple(packed_seq_ids.shape)}. For a bool "
                "padding mask (True = padding, Megatron's convention) pass it as padding_mask"
            )
        if packed_seq_ids.dim() != 2 or packed_seq_ids.dtype.is_floating_point:
            raise ValueError(
                f"packed_seq_ids must be an integer tensor [batch, sequence]; got dtype "
                f"{packed_seq_ids.dtype} and shape {tuple(packed_seq_ids.shape)}"
            )
        _require_data("packed_seq_ids", packed_seq_ids)
        return DocumentMapSource("packed_seq_ids", packed_seq_ids)
    if attention_mask is not None:
        if attention_mask.dim() == 2:
            # Bool is refused: its polarity (keep vs. mask out) differs between conventions.
            if attention_mask.dtype.is_floating_point or attention_mask.dtype == torch.bool:
                raise ValueError(
                    "a 2-D attention_mask must hold integer document ids (0 = padding); got "
                    f"dtype {attention_mask.dtype}"
                )
            _require_data("attention_mask", attention_mask)
            return DocumentMapSource("attention_mask_2d", attention_mask)
        if attention_mask.dim() == 4:
            b, h, s, s2 = attention_mask.shape
            if attention_mask.dtype != torch.bool or h != 1 or s != s2:
                raise ValueError(
                    "a 4-D attention_mask must be bool [batch, 1, sequence, sequence] "
                    f"(True = keep); got dtype {attention_mask.dtype} and shape "
                    f"{tuple(attention_mask.shape)}"
                )
            _require_data("attention_mask", attention_mask)
            return DocumentMapSource("attention_mask_4d", attention_mask)
        raise ValueError(
            "attention_mask must be 2-D document ids [batch, sequence] or a bool 4-D "
            f"block-causal mask [batch, 1, sequence, sequence]; got shape "
            f"{tuple(attention_mask.shape)}"
        )
    if padding_mask is not None:
        if padding_mask.dim() != 2 or padding_mask.dtype != torch.bool:
            raise ValueError(
                "padding_mask must be bool [batch, sequence] with True marking padding; got "
                f"dtype {padding_mask.dtype} and shape {tuple(padding_mask.shape)}"
            )
        _require_data("padding_mask", padding_mask)
        return DocumentMapSource("padding_mask", padding_mask)
    return DocumentMapSource("none", None)


def _require_data(name: str, tensor: torch.Tensor) -> None:
    """Refuse a source tensor without data: the layout reads the document ids once."""
    if tensor.is_meta:
        raise ValueError(
            f"{name} is on the meta device (a shape without data); expected the document map "
            "as a tensor with data on the CPU or a CUDA device (the layout reads it once)"
        )


def layout_device(device: torch.device | str | None) -> torch.device:
    """The device a layout without a source is built on, checked against this machine.

    Raises:
        ValueError: naming ``device`` when it is not a device name, is ``meta`` (no data), or
            names a CUDA device this machine does not have.
    """
    try:
        on = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device = {device!r} is not a torch device; expected e.g. 'cpu' or "
                         "'cuda'") from None
    if on.type == "meta":
        raise ValueError(f"device = {device!r}: expected a device with data (the layout holds "
                         "token indices), e.g. 'cpu' or 'cuda'")
    if on.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device = {device!r} but this machine has no CUDA device "
                             "(torch.cuda.is_available() is False); expected 'cpu'")
        if on.index is not None and on.index >= count:
            raise ValueError(f"device = {device!r} but this machine has {count} CUDA "
                             f"device(s); expected an index below {count}")
    return on


def document_map_from_source(
    source: DocumentMapSource, batch_size: int | None, seq_len: int | None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turns a source into an int64 document map, without validating it.

    Args:
        source: from :func:`select_document_map_source`.
        batch_size: required when the source is ``none``; checked against the source otherwise.
        seq_len: likewise.
        device: device of the map when the source is ``none``.

    Returns:
        ``(document_map, bad_mask_row)``: int64 [b, s], and an int64 scalar tensor holding the
        first row of a 4-D mask that is not exactly block-causal (a large sentinel if none).

    Raises:
        ValueError: no source and no ``batch_size`` / ``seq_len``, a ``device`` this machine
            does not have (:func:`layout_device`), or sizes that disagree with the source.
    """
    def no_bad(on: torch.device | str | None) -> torch.Tensor:
        # Filled on the device: a host tensor moved there would be a second synchronization.
        return torch.full((), _NO_BAD_ROW, dtype=torch.int64, device=on)

    if source.name == "none":
        if batch_size is None or seq_len is None:
            raise ValueError(
                "batch_size and seq_len are required when no packed_seq_ids, attention_mask or "
                f"padding_mask is given; got batch_size={batch_size}, seq_len={seq_len}"
            )
        _check_extent(batch_size, seq_len)
        ones = torch.ones(batch_size, seq_len, dtype=torch.int64, device=layout_device(device))
        return ones, no_bad(ones.device)

    tensor = source.tensor
    b, s = tensor.shape[0], tensor.shape[-1]
    if batch_size is not None and batch_size != b:
        raise ValueError(f"{source.name} has batch {b} but batch_size={batch_size} was given")
    if seq_len is not None and seq_len != s:
        raise ValueError(f"{source.name} has sequence {s} but seq_len={seq_len} was given")
    _check_extent(b, s)

    if source.name in ("packed_seq_ids", "attention_mask_2d"):
        return tensor.to(torch.int64), no_bad(tensor.device)
    if source.name == "padding_mask":
        return (~tensor).to(torch.int64), no_bad(tensor.device)
    return _document_map_from_block_causal(tensor[:, 0])


def _check_extent(batch_size: int, seq_len: int) -> None:
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(
            f"the document map is empty: batch_size={batch_size}, seq_len={seq_len}; expected both"
            " > 0"
        )
    if batch_size * seq_len > INT32_MAX:
        raise ValueError(
            f"batch_size * seq_len = {batch_size * seq_len} is past int32 "
            f"({INT32_MAX}); kernels index tokens with int32"
        )


def _document_map_from_block_causal(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads document ids off a bool [b, s, s] block-causal mask and checks it exactly.

    A real token keeps itself (the diagonal); its document starts at the first kept key of its
    row. The mask is rebuilt from the recovered map and compared element by element.
    """
    b, s, _ = mask.shape
    positions = torch.arange(s, device=mask.device)
    real = torch.diagonal(mask, dim1=1, dim2=2)
    # First kept column of each row; rows with no kept column get s (never a document start).
    first_kept = torch.where(mask, positions, s).amin(dim=2)
    starts = real & (first_kept == positions)
    ids = torch.cumsum(starts.to(torch.int64), dim=1) * real.to(torch.int64)
    same_doc = ids[:, :, None] == ids[:, None, :]
    expected = same_doc & real[:, :, None] & (positions[None, :, None] >= positions[None, None, :])
    bad_rows = (expected != mask).any(dim=2).reshape(-1)
    row_ids = torch.arange(b * s, device=mask.device)
    bad = torch.where(bad_rows, row_ids, _NO_BAD_ROW).amin()
    return ids, bad


@dataclass(frozen=True)
class DocumentMapSummary:
    """Host-side sizes of a validated document map (the one host synchronization).

    Attributes:
        num_tokens: real tokens T.
        num_documents: documents D.
        max_seqlen: the longest document's length.
        num_workspace_blocks: blocks of the aligned workspace.
        document_lengths: the D document lengths in row-major document order (host ints), for
            host-side plans such as per-document dense attention calls.
    """

    num_tokens: int
    num_documents: int
    max_seqlen: int
    num_workspace_blocks: int
    document_lengths: tuple[int, ...] = ()


def summarize_document_map(
    document_map: torch.Tensor, bad_mask_row: torch.Tensor, block_size: int, source_name: str
) -> tuple[DocumentMapSummary, dict[str, torch.Tensor]]:
    """Validates a document map and returns its sizes with one device-to-host copy.

    Args:
        document_map: int64 [b, s]; 0 = padding, positive ids are contiguous runs per row.
        bad_mask_row: int64 scalar from :func:`document_map_from_source`.
        block_size: key-block size of the aligned workspace.
        source_name: for error messages.

    Returns:
        ``(summary, device_tensors)``: the host sizes, and device tensors the layout builder
        reuses (``real`` bool [b*s], ``starts`` bool [b*s], ``local_positions`` int64 [b*s]).

    Raises:
        ValueError: negative ids, no real token, an interrupted document, a 4-D mask that is not
            block-causal, or a workspace past int32; the message names the first bad row.
    """
    b, s = document_map.shape
    device = document_map.device
    flat = document_map.reshape(-1)
    flat_index = torch.arange(b * s, device=device)
    column = flat_index % s
    real = flat > 0
    previous = torch.roll(flat, 1)
    starts = real & ((column == 0) | (previous != flat))
    # Position inside the run: distance to the last run start at or before this token.
    last_start = torch.cummax(torch.where(starts, flat_index, -1), dim=0).values
    local_positions = flat_index - last_start

    def first_row(bad_rows: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(bad_rows.numel(), device=device)
        return torch.where(bad_rows, rows, _NO_BAD_ROW).amin()

    negative_row = first_row((document_map < 0).any(dim=1))
    # A document is interrupted when its id starts more than one run in its row: compare the
    # number of runs with the number of distinct positive ids, per row.
    runs_per_row = starts.reshape(b, s).sum(dim=1)
    ordered = torch.sort(document_map, dim=1).values
    distinct = (ordered > 0) & (
        torch.cat([torch.ones_like(ordered[:, :1], dtype=torch.bool),
                   ordered[:, 1:] != ordered[:, :-1]], dim=1)
    )
    interrupted_row = first_row(runs_per_row != distinct.sum(dim=1))

    num_tokens = real.sum()
    report = torch.stack(
        [
            num_tokens,
            starts.sum(),
            torch.where(real, local_positions + 1, 0).amax(),
            (real & (local_positions % block_size == 0)).sum(),
            negative_row,
            interrupted_row,
            bad_mask_row,
        ]
    )
    # A document's length sits at its last token (the next flat token starts a new run, is
    # padding, or begins the next row); 0 elsewhere. It travels with the report in one copy.
    following = torch.roll(flat, -1)
    ends = real & ((column == s - 1) | (following != flat))
    lengths_at_ends = torch.where(ends, local_positions + 1, 0)
    # The one device-to-host synchronization of the layout: the report and the lengths, int32
    # (every value is below 2**31: sizes are checked against int32, the sentinel is INT32_MAX).
    host = torch.cat([report, lengths_at_ends]).to(torch.int32).cpu().numpy()
    (tokens, documents, max_seqlen, blocks, negative, interrupted, bad_mask) = (
        int(x) for x in host[: report.numel()]
    )

    if bad_mask != _NO_BAD_ROW:
        row, query = divmod(bad_mask, s)
        raise ValueError(
            f"attention_mask is not block-causal over contiguous documents: first bad row is "
            f"batch {row}, query {query} (expected each real query to keep exactly the keys of "
            "its own document up to itself, and padding rows to be all False)"
        )
    if negative != _NO_BAD_ROW:
        raise ValueError(
            f"{source_name} holds negative document ids in row {negative}; expected 0 for "
            "padding and positive ids for documents"
        )
    if tokens == 0:
        raise ValueError(f"{source_name} holds no real token (every entry is padding)")
    if interrupted != _NO_BAD_ROW:
        raise ValueError(
            f"{source_name} row {interrupted} interrupts a document: each positive id must be "
            "one contiguous run of tokens within its row"
        )
    if blocks * block_size > INT32_MAX:
        raise ValueError(
            f"the aligned workspace needs {blocks * block_size} rows, past int32 ({INT32_MAX})"
        )
    ended = host[report.numel() :]
    document_lengths = tuple(int(x) for x in ended[ended > 0])
    summary = DocumentMapSummary(tokens, documents, max_seqlen, blocks, document_lengths)
    return summary, {"real": real, "starts": starts, "local_positions": local_positions}
