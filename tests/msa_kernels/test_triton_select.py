"""Triton block selection vs a brute-force float64 reference (interpreter on CPU, compiled on a
CUDA GPU; the inputs and the reference are the same host tensors either way)."""

from __future__ import annotations

import pytest
import torch
from _msa_support import layout_on_kernel_device, make_layout, on_kernel_device

from nemo_msa.selection.triton_select import triton_select_blocks
from nemo_msa.testing.oracle import select_f64


def _inputs(msa, h, d, integer, gen):
    t = msa.num_tokens
    if integer:
        # Small integers: every q.k is exact in fp32, so ties are real and the tie rule is tested.
        q = torch.randint(-2, 3, (t, h, d), generator=gen).to(torch.bfloat16)
        k = torch.randint(-2, 3, (t, d), generator=gen).to(torch.bfloat16)
    else:
        q = torch.randn((t, h, d), generator=gen).to(torch.bfloat16)
        k = torch.randn((t, d), generator=gen).to(torch.bfloat16)
    return q, k


@pytest.mark.parametrize(
    "rows,seq_len,bs,d,top_k,init,local,integer",
    [
        ([[1, 16, 33, 64, 5]], 128, 16, 16, 4, 0, 1, False),
        ([[40, 1], [16, 57], [80]], 100, 16, 32, 3, 1, 1, True),
        ([[200]], 200, 16, 16, 5, 1, 2, False),
        ([[150, 3], [97]], 160, 32, 16, 4, 0, 1, True),
    ],
)
def test_selection_matches_reference(rows, seq_len, bs, d, top_k, init, local, integer):
    gen = torch.Generator().manual_seed(hash((seq_len, bs, d, top_k)) % 2**31)
    msa = make_layout(rows, seq_len, bs)
    q, k = _inputs(msa, 2, d, integer, gen)
    got = triton_select_blocks(*on_kernel_device(q, k), layout_on_kernel_device(msa), top_k=top_k,
                               init_blocks=init, local_blocks=local, block_size=bs).cpu()
    ref, _ = select_f64(q, k, msa, top_k=top_k, init_blocks=init, local_blocks=local,
                              block_size=bs)
    assert got.dtype == torch.int32 and got.shape == ref.shape
    mism = (got != ref).any(-1)
    assert not mism.any(), f"{int(mism.sum())} rows differ; first at {mism.nonzero()[0].tolist()}"


def test_selection_pointer_loads_match_reference(set_launch):
    """The selection with TMA off (whole key blocks by pointer loads; the path of GPUs before
    Hopper) gives the reference's selection too."""
    set_launch({"sel.tma": False})
    test_selection_matches_reference([[40, 1], [16, 57], [80]], 100, 16, 32, 3, 1, 1, True)


def test_selection_nan_ranks_last():
    """A NaN key ranks its block last, in its own document only (the NaN-keeping block max)."""
    gen = torch.Generator().manual_seed(7)
    # Two documents in one row: a non-finite key of document 2 must not mark document 1's
    # block of the same local id.
    msa = make_layout([[40, 96]], 136, 16)
    q, k = _inputs(msa, 1, 16, False, gen)
    k[40 + 20] = float("nan")  # document 2's block 1 scores NaN for every query that sees it
    got = triton_select_blocks(*on_kernel_device(q, k), layout_on_kernel_device(msa), top_k=3,
                               init_blocks=0, local_blocks=1, block_size=16).cpu()
    ref, _ = select_f64(q, k, msa, top_k=3, init_blocks=0, local_blocks=1, block_size=16)
    assert torch.equal(got, ref)
    # From block 3 on there are more candidates than slots: block 1 (NaN) must be dropped.
    assert not (got[0, 40 + 48:] == 1).any(), "a NaN-scored block was chosen over finite ones"
    assert (got[0, 16:40] == 1).any(-1).all(), "document 1's block 1 is finite and must stay chosen"


def test_selection_nan_query_row_and_infinite_keys_match_reference():
    """Exact reference semantics of the NaN-keeping block max: a NaN query row ranks every
    free block last (ties to the lower id), and an infinite key makes its block's score +inf or
    -inf by the sign of q.k, not NaN."""
    gen = torch.Generator().manual_seed(5)
    msa = make_layout([[150, 3], [16, 57]], 160, 16)
    q, k = _inputs(msa, 2, 16, False, gen)
    q[140, 1, 2] = float("nan")
    k[37, 0] = float("inf")  # block 2 of document 1: +inf for q[., 0] > 0, -inf for q < 0
    k[70, 5] = float("-inf")  # block 4
    k[100] = float("inf")  # every channel: q.k = +-inf, or NaN where the signs differ
    got = triton_select_blocks(*on_kernel_device(q, k), layout_on_kernel_device(msa), top_k=4,
                               init_blocks=0, local_blocks=1, block_size=16).cpu()
    ref, scores = select_f64(q, k, msa, top_k=4, init_blocks=0, local_blocks=1,
                                   block_size=16)
    s1 = scores[0]  # document 1: [H, n, blocks]
    assert torch.isposinf(s1[:, 60:, 2]).any() and torch.isnan(s1[:, 110:, 6]).any(), \
        "the case must hold +inf and NaN block scores"
    assert torch.equal(got, ref)


def test_selection_rejects_bad_arguments():
    msa = make_layout([[32]], 32, 16)
    q = torch.zeros((32, 1, 16), dtype=torch.bfloat16)
    k = torch.zeros((32, 16), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot run msa_topk=40: the Triton kernels take 1..32"):
        triton_select_blocks(q, k, msa, top_k=40, init_blocks=0, local_blocks=1, block_size=16)
    with pytest.raises(ValueError, match="index_k"):
        triton_select_blocks(q, k[:, :8], msa, top_k=4, init_blocks=0, local_blocks=1,
                             block_size=16)
    with pytest.raises(ValueError, match="index_k is on meta: expected a (cpu|cuda) tensor"):
        triton_select_blocks(on_kernel_device(q), k.to("meta"), layout_on_kernel_device(msa),
                             top_k=4, init_blocks=0, local_blocks=1, block_size=16)
    with pytest.raises(ValueError, match="dtype"):
        triton_select_blocks(q.float(), k.float(), msa, top_k=4, init_blocks=0, local_blocks=1,
                             block_size=16)
