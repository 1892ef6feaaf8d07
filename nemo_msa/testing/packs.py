"""Document maps of packed rows, for tests and benchmarks that spell documents by their lengths."""

from __future__ import annotations

import torch

__all__ = ["document_map_from_lengths"]


def document_map_from_lengths(
    rows: list[list[int]], seq_len: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The int64 [len(rows), seq_len] document map of packed rows.

    Args:
        rows: per batch row, its documents' lengths in order; the rest of the row is padding.
        seq_len: the padded row length.
        device: where the map lives.

    Returns:
        Document ids 1, 2, ... per row in order, 0 at padding.

    Raises:
        ValueError: a row whose documents do not fit ``seq_len``, or a length below 1.
    """
    ids = torch.zeros((len(rows), seq_len), dtype=torch.int64)
    for r, docs in enumerate(rows):
        if sum(docs) > seq_len or any(n < 1 for n in docs):
            raise ValueError(f"rows[{r}]={docs}: expected lengths >= 1 summing to <= "
                             f"seq_len={seq_len}")
        off = 0
        for i, n in enumerate(docs):
            ids[r, off:off + n] = i + 1
            off += n
    return ids.to(device)
