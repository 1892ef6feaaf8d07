"""Check a Megatron indexed dataset (``PREFIX.idx`` / ``PREFIX.bin``) before Megatron opens it.

Megatron's reader (``megatron.core.datasets.indexed_dataset._IndexReader``) trusts the files: a
text file as ``.idx`` fails with "49 is not a valid DType", an empty ``.bin`` with "cannot mmap
an empty file", a truncated ``.bin`` only when a sample past its end is read; none names the
file. :func:`check_indexed_files` reads the same layout and says which file is wrong and what
was expected.

The ``.idx`` layout (little-endian), as ``_IndexWriter`` writes it::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    8 bytes   version (uint64) = 1
    1 byte    token dtype code (DType: 1 uint8 ... 8 uint16)
    8 bytes   S, the number of sequences (uint64)
    8 bytes   D, the number of document indices (uint64) = documents + 1
    S int32   sequence lengths (tokens)
    S int64   sequence pointers (byte offsets into .bin)
    D int64   document indices (sequence index where each document starts; 0 first, S last)
    [S int8   sequence modes, multimodal datasets only]

and ``.bin`` holds the tokens, sequence after sequence, so its size is the last pointer plus the
last length times the dtype's size. Cost: one pass over the index's arrays (16 Mi entries at a
time through a memory map); the ``.bin`` is only stat'ed.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

from nemo_msa.training.recipe_fields import RecipeError

_HEADER_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8
_CHUNK = 1 << 24
_KEY = "recipe key 'dataset.data_path'"
_WRITTEN_BY = "written by Megatron's IndexedDatasetBuilder / preprocess_data.py"


def _bad(path: Path, what: str) -> RecipeError:
    return RecipeError(f"{_KEY}: {path} {what}")


def _header(idx: Path) -> tuple[np.dtype, int, int]:
    """The token dtype, S and D of an index file whose header is sound."""
    size = idx.stat().st_size
    if size < _HEADER_BYTES:
        raise _bad(idx, f"is {size} bytes, too short for an index (expected a {_HEADER_BYTES}-"
                        f"byte header and the sequence arrays, {_WRITTEN_BY})")
    with open(idx, "rb") as fh:
        head = fh.read(_HEADER_BYTES)
    magic, (version,), code = (head[:9], struct.unpack("<Q", head[9:17]), head[17])
    if magic != _INDEX_HEADER:
        raise _bad(idx, f"starts with {magic!r}, not the index magic {_INDEX_HEADER!r} (expected "
                        f"an index file {_WRITTEN_BY})")
    if version != 1:
        raise _bad(idx, f"has index version {version}; expected version 1")
    codes = {d.value: d.name for d in DType}
    if code not in codes:
        raise _bad(idx, f"has token dtype code {code}; expected one of "
                        f"{', '.join(f'{c} ({n})' for c, n in sorted(codes.items()))}")
    sequences, doc_indices = struct.unpack("<QQ", head[18:34])
    return np.dtype(codes[code]), sequences, doc_indices


def _check_arrays(idx: Path, dtype: np.dtype, sequences: int, doc_indices: int) -> int:
    """Check lengths, pointers and document indices; return the tokens' byte size."""
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=_HEADER_BYTES, shape=(sequences,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=_HEADER_BYTES + 4 * sequences,
                         shape=(sequences,))
    docs = np.memmap(idx, dtype=np.int64, mode="r", offset=_HEADER_BYTES + 12 * sequences,
                     shape=(doc_indices,))
    expected = 0
    for start in range(0, sequences, _CHUNK):
        length = lengths[start:start + _CHUNK].astype(np.int64)
        if (length < 0).any():
            i = start + int(np.argmax(length < 0))
            raise _bad(idx, f"gives sequence {i} a length of {int(lengths[i])} tokens; expected "
                            "lengths >= 0 (a damaged index)")
        ends = expected + np.cumsum(length * dtype.itemsize)
        starts = np.concatenate(([expected], ends[:-1]))
        wrong = pointers[start:start + _CHUNK] != starts
        if wrong.any():
            i = int(np.argmax(wrong))
            raise _bad(idx, f"points sequence {start + i} at byte {int(pointers[start + i])}; "
                            f"expected {int(starts[i])}, where the sequence before it ends (a "
                            "damaged index)")
        expected = int(ends[-1])
    steps = np.diff(docs) if doc_indices > 1 else np.zeros(0, np.int64)
    if docs[0] != 0 or docs[-1] != sequences or (steps < 0).any():
        raise _bad(idx, f"has document indices from {int(docs[0])} to {int(docs[-1])}; expected "
                        f"0 to {sequences}, ascending (a damaged index)")
    del lengths, pointers, docs
    return expected


def check_indexed_files(prefix: str) -> None:
    """Check ``prefix.idx`` and ``prefix.bin`` against Megatron's format (module docstring).

    Raises:
        RecipeError: naming ``dataset.data_path``, the file and what was expected: a missing
            file, a short or foreign index (magic, version, dtype code), an index whose size
            disagrees with its counts, no documents or no tokens (an empty corpus), damaged
            arrays, or a ``.bin`` whose size is not the one its index describes (truncated, or
            the pair belongs to different corpora).
    """
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for path in (idx, bin_):
        if not path.is_file():
            raise _bad(path, f"does not exist (expected the .bin/.idx pair {_WRITTEN_BY})")
    dtype, sequences, doc_indices = _header(idx)
    arrays = 12 * sequences + 8 * doc_indices
    size = idx.stat().st_size
    if size not in (_HEADER_BYTES + arrays, _HEADER_BYTES + arrays + sequences):
        raise _bad(idx, f"is {size} bytes but its header counts {sequences} sequences and "
                        f"{doc_indices} document indices (expected {_HEADER_BYTES + arrays} "
                        "bytes): truncated, or not an index")
    if sequences == 0 or doc_indices < 2:
        raise _bad(idx, f"holds no documents ({sequences} sequences): an empty corpus; expected "
                        "at least one document")
    tokens_bytes = _check_arrays(idx, dtype, sequences, doc_indices)
    if tokens_bytes == 0:
        raise _bad(idx, f"holds {sequences} sequences of 0 tokens: an empty corpus; expected "
                        "documents with tokens")
    bin_size = os.stat(bin_).st_size
    if bin_size != tokens_bytes:
        raise _bad(bin_, f"is {bin_size} bytes but its index {idx.name} describes "
                         f"{tokens_bytes // dtype.itemsize} {dtype.name} tokens ({tokens_bytes} "
                         f"bytes): {'truncated' if bin_size < tokens_bytes else 'longer'}, or "
                         "the .bin and .idx belong to different corpora")


__all__ = ["check_indexed_files"]
