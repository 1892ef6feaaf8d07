"""Shared helpers of the Triton kernel tests: layouts of packed rows and random selections.

The float64 references are nemo_msa.testing.oracle's (shared with benchmarks/bench_msa.py).
"""

from __future__ import annotations

import torch

from nemo_msa import MSAMicrobatch
from nemo_msa.testing.packs import document_map_from_lengths

#: Where the kernels run in these tests: compiled on a CUDA GPU, else under the interpreter on
#: the host. Inputs and float64 references are built on the host either way (same seeds, same
#: cases); only the kernel calls see device tensors.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_kernel_device(*tensors: torch.Tensor):
    """The tensors moved to :data:`KERNEL_DEVICE` (a tuple, or one tensor for one argument)."""
    moved = tuple(x.to(KERNEL_DEVICE) for x in tensors)
    return moved[0] if len(moved) == 1 else moved


def layout_on_kernel_device(msa: MSAMicrobatch) -> MSAMicrobatch:
    """The same layout built from its document map on :data:`KERNEL_DEVICE`."""
    ids = torch.zeros(msa.batch_size * msa.seq_len, dtype=torch.int64)
    ids[msa.token_rows.cpu()] = msa.token_documents.cpu().long() + 1
    init_blocks, local_blocks = msa.forced_blocks
    return MSAMicrobatch.from_document_map(
        ids.view(msa.batch_size, msa.seq_len).to(KERNEL_DEVICE), block_size=msa.block_size,
        init_blocks=init_blocks, local_blocks=local_blocks)


def make_layout(rows: list[list[int]], seq_len: int, block_size: int,
                device="cpu") -> MSAMicrobatch:
    """The layout of documents packed into padded rows (what the kernels take in production).

    Args:
        rows: per batch row, the document lengths in order (the rest of the row is padding).
        seq_len: padded row length.
        block_size: MSA block size.
        device: where the tensors live.
    """
    return MSAMicrobatch.from_document_map(
        document_map_from_lengths(rows, seq_len, device), block_size=block_size)


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
