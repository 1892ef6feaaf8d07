"""Random packed batches for the core tests (hypothesis strategies and plain generators)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


def document_map_from_rows(rows: list[list[tuple[int, int]]], seq_len: int) -> torch.Tensor:
    """Builds an int64 [b, s] map from rows of (document length, padding after it) runs."""
    out = torch.zeros(len(rows), seq_len, dtype=torch.int64)
    for r, runs in enumerate(rows):
        col, doc = 0, 0
        for length, pad in runs:
            doc += 1
            out[r, col : col + length] = doc
            col += length + pad
        assert col <= seq_len
    return out


@st.composite
def packed_batches(draw, max_batch: int = 3, max_seq: int = 1024, block_sizes=(16, 32, 64)):
    """A (document_map, block_size) pair: random lengths incl. 1 and exact block multiples.

    Every row holds at least one real token; padding runs appear between and after documents.
    """
    block = draw(st.sampled_from(block_sizes))
    batch = draw(st.integers(1, max_batch))
    seq = draw(st.integers(1, max_seq))
    rows = []
    for _ in range(batch):
        runs, used = [], 0
        while used < seq:
            room = seq - used
            kind = draw(st.sampled_from(["one", "multiple", "any"]))
            if kind == "one":
                length = 1
            elif kind == "multiple" and room >= block:
                length = block * draw(st.integers(1, room // block))
            else:
                length = draw(st.integers(1, room))
            pad = draw(st.integers(0, min(room - length, 7))) if draw(st.booleans()) else 0
            runs.append((length, pad))
            used += length + pad
            if draw(st.integers(0, 3)) == 0:
                break
        rows.append(runs)
    return document_map_from_rows(rows, seq), block


def random_document_map(
    generator: torch.Generator, batch: int, seq: int, max_doc: int, pad_prob: float = 0.3
) -> torch.Tensor:
    """A random map for larger, non-hypothesis tests."""
    out = torch.zeros(batch, seq, dtype=torch.int64)
    for r in range(batch):
        col, doc = 0, 0
        while col < seq:
            length = int(torch.randint(1, max_doc + 1, (1,), generator=generator))
            length = min(length, seq - col)
            doc += 1
            out[r, col : col + length] = doc
            col += length
            if torch.rand((), generator=generator) < pad_prob:
                col += int(torch.randint(1, 9, (1,), generator=generator))
    if not (out > 0).any():
        out[0, 0] = 1
    return out
