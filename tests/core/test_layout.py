"""The layout: pack/unpack, workspace invariants, the weak-id memo, one host sync per build."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from hypothesis import given, settings
from packs import packed_batches
from torch.overrides import TorchFunctionMode

from nemo_msa import MSAMicrobatch
from nemo_msa.testing.op_count import OpCounter
from nemo_msa.testing.packs import document_map_from_lengths
from nemo_msa.triton.kernel_layout import build_kernel_layout


def expected_documents(ids: torch.Tensor):
    """Independent reading of a map: list of (row, first column, length) in row-major order."""
    docs = []
    for r, row in enumerate(ids.tolist()):
        c = 0
        while c < len(row):
            if row[c] > 0:
                start = c
                while c < len(row) and row[c] == row[start]:
                    c += 1
                docs.append((r, start, c - start))
            else:
                c += 1
    return docs


@settings(max_examples=60, deadline=None)
@given(packed_batches(max_batch=3, max_seq=3000))
def test_layout_matches_an_independent_reading_of_the_map(case):
    ids, block = case
    msa = MSAMicrobatch.from_document_map(ids, block_size=block)
    docs = expected_documents(ids)
    b, s = ids.shape
    assert msa.num_documents == len(docs)
    assert msa.num_tokens == sum(length for _, _, length in docs)
    assert msa.max_seqlen == max(length for _, _, length in docs)
    lengths = [length for _, _, length in docs]
    assert (msa.cu_seqlens[1:] - msa.cu_seqlens[:-1]).tolist() == lengths
    assert msa.document_lengths == tuple(lengths)  # the host copy, read in the build's one sync

    rows = [r * s + c + j for r, c, length in docs for j in range(length)]
    assert msa.token_rows.tolist() == rows
    assert msa.document_positions.tolist() == [j for *_, n in docs for j in range(n)]
    assert msa.token_documents.tolist() == [d for d, (*_, n) in enumerate(docs) for _ in range(n)]

    # Workspace: every document starts on a block boundary, in order, without overlap.
    starts = msa.document_workspace_starts.tolist()
    assert all(start % block == 0 for start in starts)
    expected_starts, at = [], 0
    for n in lengths:
        expected_starts.append(at)
        at += -(-n // block) * block
    assert starts == expected_starts and msa.workspace_size == at
    ws = msa.workspace_positions
    assert torch.equal(ws, msa.document_workspace_starts[msa.token_documents.long()]
                       + msa.document_positions)
    assert len(set(ws.tolist())) == msa.num_tokens


@settings(max_examples=40, deadline=None)
@given(packed_batches(max_batch=3, max_seq=1500))
def test_pack_unpack_and_workspace_round_trip(case):
    ids, block = case
    msa = MSAMicrobatch.from_document_map(ids, block_size=block)
    x = torch.randn(*ids.shape, 3, 2)
    packed = msa.pack(x)
    assert packed.shape == (msa.num_tokens, 3, 2)
    back = msa.unpack(packed)
    real = ids > 0
    assert torch.equal(back[real], x[real])
    assert torch.all(back[~real] == 0)
    ws = msa.to_workspace(packed)
    assert torch.equal(msa.from_workspace(ws), packed)
    gaps = torch.ones(msa.workspace_size, dtype=torch.bool)
    gaps[msa.workspace_positions] = False
    assert torch.all(ws[gaps] == 0)
    # Per-document positions for RoPE restart at every document and are 0 at padding.
    pos = msa.position_ids()
    assert torch.all(pos[~real] == 0)
    starts = real & torch.cat([torch.ones_like(ids[:, :1], dtype=torch.bool),
                               ids[:, 1:] != ids[:, :-1]], dim=1)
    assert torch.all(pos[starts] == 0)
    # A caller writing into what it got changes nothing for the next caller (issue #29).
    pos += 100
    assert torch.all(msa.position_ids()[starts] == 0)


@settings(max_examples=40, deadline=None)
@given(packed_batches(max_batch=3, max_seq=1500))
def test_kernel_layout_matches_an_independent_reading_and_launches_nothing(case):
    """The Triton kernels' view is built on the host from the document lengths and uploaded in
    one copy (issue #50: about twenty small device ops before): every map equals a per-document
    reading of the map, for the layout's block size and a larger one, and on the CPU the build
    runs no kernel-launching op at all."""
    ids, block = case
    msa = MSAMicrobatch.from_document_map(ids, block_size=block)
    docs = expected_documents(ids)
    for bs in (block, 128):
        with OpCounter() as ops:
            view = build_kernel_layout(msa, bs)
        assert ops.total == 0, ops.table()
        block_doc, block_local, first, token_first, token_start = [], [], [], [], []
        at = 0
        for d, (*_, n) in enumerate(docs):
            blocks = -(-n // bs)
            first.append(len(block_doc))
            block_doc += [d] * blocks
            block_local += list(range(blocks))
            token_first += [first[-1]] * n
            token_start += [at] * n
            at += n
        bound = msa.num_tokens // bs + msa.num_documents
        assert view.num_blocks_bound == bound >= len(block_doc)
        pad = bound - len(block_doc)
        assert view.block_doc.dtype == view.block_local.dtype == torch.int32
        assert view.block_doc.tolist() == block_doc + [-1] * pad
        assert view.block_local.tolist() == block_local + [0] * pad
        assert view.doc_first_block.dtype == view.token_first_block.dtype == torch.int64
        assert view.doc_first_block.tolist() == first
        assert view.token_first_block.tolist() == token_first
        assert view.token_start.dtype == torch.int32 and view.token_start.tolist() == token_start
        assert torch.equal(view.token_pos, msa.document_positions)
        for x in (view.block_doc, view.block_local, view.doc_first_block, view.token_first_block,
                  view.token_start):
            assert x.data_ptr() % 16 == 0  # the kernels' pointers are specialized on alignment


def test_kernel_layout_refuses_host_lengths_that_disagree_with_the_layout():
    msa = MSAMicrobatch.from_document_map(torch.tensor([[1] * 20 + [2] * 12]), block_size=16)
    bad = copy.copy(msa)
    object.__setattr__(bad, "document_lengths", (20, 11))
    with pytest.raises(ValueError, match=r"document_lengths holds 2 lengths summing to 31"):
        build_kernel_layout(bad, 16)


def test_pack_and_unpack_reject_wrong_shapes():
    msa = MSAMicrobatch.build(batch_size=2, seq_len=4, block_size=16)
    for bad, call in ((torch.zeros(2, 5), msa.pack), (torch.zeros(7, 3), msa.unpack)):
        try:
            call(bad)
        except ValueError as err:
            assert str(tuple(bad.shape)) in str(err)
        else:
            raise AssertionError("expected ValueError")


class SyncCounter(TorchFunctionMode):
    """Counts calls that force a device-to-host copy (or would on a GPU)."""

    SYNCING = {
        torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
        torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
        torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.masked_select,
        torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.repeat_interleave,
    }

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SYNCING:
            self.calls.append(func.__name__)
        if func is torch.Tensor.__getitem__ and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool
            for a in (args[1] if isinstance(args[1], tuple) else (args[1],))
        ):
            self.calls.append("bool-index")
        return func(*args, **kwargs)


def test_building_a_layout_costs_exactly_one_host_sync():
    ids = torch.tensor([[1] * 40 + [2] * 90 + [0] * 6, [3] * 136])
    with SyncCounter() as counter:
        msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=32)
    # One device-to-host copy (report and document lengths together); numpy reads that host copy.
    assert counter.calls == ["cpu", "numpy"], counter.calls
    # Derived tables and the data movement of a step add none.
    with SyncCounter() as counter:
        x = msa.pack(torch.randn(2, 136, 4))
        msa.unpack(x)
        msa.to_workspace(x)
        msa.position_ids()
        _ = msa.workspace_documents, msa.token_workspace_block_starts
    assert counter.calls == [], counter.calls


def test_memo_builds_once_for_every_layer_and_deep_copied_module():
    ids = torch.tensor([[1] * 50 + [2] * 14])
    layer = torch.nn.Linear(2, 2)
    layers = [layer, copy.deepcopy(layer), copy.deepcopy(layer)]
    before = MSAMicrobatch.num_builds()
    layouts = [MSAMicrobatch.build(packed_seq_ids=ids, block_size=16) for _ in layers]
    assert MSAMicrobatch.num_builds() - before == 1
    assert all(m is layouts[0] for m in layouts)
    # A different tensor with equal values is a different batch: a new build.
    other = MSAMicrobatch.build(packed_seq_ids=ids.clone(), block_size=16)
    assert other is not layouts[0] and MSAMicrobatch.num_builds() - before == 2


def test_memo_rebuilds_after_an_in_place_write():
    ids = torch.tensor([[1] * 30 + [2] * 34])
    first = MSAMicrobatch.build(packed_seq_ids=ids, block_size=16)
    ids[0, 10:] = 3  # _version bumps
    second = MSAMicrobatch.build(packed_seq_ids=ids, block_size=16)
    assert second is not first
    assert second.cu_seqlens.tolist() == [0, 10, 64]
    assert MSAMicrobatch.build(packed_seq_ids=ids, block_size=16) is second


def test_memo_entry_dies_with_the_batch_tensor():
    gc.collect()
    base = MSAMicrobatch.memo_size()
    ids = torch.tensor([[1] * 20 + [2] * 12])
    MSAMicrobatch.build(packed_seq_ids=ids, block_size=16)
    assert MSAMicrobatch.memo_size() == base + 1
    del ids
    gc.collect()
    assert MSAMicrobatch.memo_size() == base


def test_memo_distinguishes_block_size_and_forced_blocks():
    ids = torch.tensor([[1] * 64])
    a = MSAMicrobatch.build(packed_seq_ids=ids, block_size=16)
    b = MSAMicrobatch.build(packed_seq_ids=ids, block_size=32)
    c = MSAMicrobatch.build(packed_seq_ids=ids, block_size=16, init_blocks=1)
    assert len({id(a), id(b), id(c)}) == 3
    assert (a.workspace_size, b.workspace_size) == (64, 64)
    assert c.forced_blocks == (1, 1)


def test_document_map_from_lengths_spells_packed_rows_and_refuses_overflow():
    ids = document_map_from_lengths([[2, 1], [3]], 4)
    assert ids.tolist() == [[1, 1, 2, 0], [1, 1, 1, 0]]
    with pytest.raises(ValueError, match=r"rows\[0\]=\[3, 2\]"):
        document_map_from_lengths([[3, 2]], 4)
    with pytest.raises(ValueError, match="lengths >= 1"):
        document_map_from_lengths([[0]], 4)
