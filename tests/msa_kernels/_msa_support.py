"""Shared helpers of the Triton kernel tests: a small layout stand-in and random selections.

The float64 references are nemo_msa.testing.oracle's (shared with scripts/bench_msa.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

#: Where the kernels run in these tests: compiled on a CUDA GPU, else under the interpreter on
#: the host. Inputs and float64 references are built on the host either way (same seeds, same
#: cases); only the kernel calls see device tensors.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_kernel_device(*tensors: torch.Tensor):
    """The tensors moved to :data:`KERNEL_DEVICE` (a tuple, or one tensor for one argument)."""
    moved = tuple(x.to(KERNEL_DEVICE) for x in tensors)
    return moved[0] if len(moved) == 1 else moved


def layout_on_kernel_device(msa):
    """A copy of a :func:`make_layout` namespace with its tensors on :data:`KERNEL_DEVICE`."""
    fields = {name: value.to(KERNEL_DEVICE) if isinstance(value, torch.Tensor) else value
              for name, value in vars(msa).items()}
    return SimpleNamespace(**fields)


def make_layout(rows: list[list[int]], seq_len: int, block_size: int, device="cpu"):
    """Builds the layout fields the kernels read, for documents packed into padded rows.

    Args:
        rows: per batch row, the document lengths in order (the rest of the row is padding).
        seq_len: padded row length.
        block_size: MSA block size.
        device: where the tensors live.

    Returns:
        A namespace with ``cu_seqlens`` int32 [D+1], ``token_documents`` int32 [T],
        ``document_positions`` int32 [T], ``token_rows`` int64 [T], host ints ``num_tokens``,
        ``num_documents``, ``max_seqlen``, ``block_size``, ``batch_size``, ``seq_len``.
    """
    lengths, token_rows = [], []
    for r, docs in enumerate(rows):
        assert sum(docs) <= seq_len
        off = 0
        for n in docs:
            lengths.append(n)
            token_rows.extend(range(r * seq_len + off, r * seq_len + off + n))
            off += n
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    docs = [d for d, n in enumerate(lengths) for _ in range(n)]
    pos = [p for n in lengths for p in range(n)]
    return SimpleNamespace(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        token_documents=torch.tensor(docs, dtype=torch.int32, device=device),
        document_positions=torch.tensor(pos, dtype=torch.int32, device=device),
        token_rows=torch.tensor(token_rows, dtype=torch.int64, device=device),
        num_tokens=cu[-1], num_documents=len(lengths), max_seqlen=max(lengths),
        block_size=block_size, batch_size=len(rows), seq_len=seq_len,
    )


def random_q2k(msa, hkv, top_k, block_size, gen, drop_own=False):
    """Random canonical-looking q2k int32 [hkv, T, top_k]: own block + random earlier ones.

    With ``drop_own`` some rows leave out their own block (legal input: the kernels must then
    mask by selection alone), and a few rows select nothing at all.
    """
    t = msa.num_tokens
    pos = msa.document_positions.tolist()
    out = torch.full((hkv, t, top_k), -1, dtype=torch.int32)
    for g in range(hkv):
        for i in range(t):
            o = pos[i] // block_size
            others = torch.randperm(o, generator=gen)[: top_k - 1].tolist() if o else []
            chosen = others + [o]
            if drop_own and i % 7 == 3:
                chosen = others
            if drop_own and i % 11 == 5:
                chosen = []
            chosen = sorted(chosen)
            out[g, i, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out
