"""The query subset's per-tile-size lists (built for every size in one [sizes, Tq] pass, issue
#28) against their definition, on random packed layouts and random ascending query sets, and
the other fields; the block -> queries CSR of the dk/dv kernel, whose layout terms are kept per
layout view."""

from __future__ import annotations

import random

import pytest
import torch

from nemo_msa import MSAMicrobatch
from nemo_msa.testing.op_count import OpCounter
from nemo_msa.triton.kernel_layout import build_query_subset, kernel_layout


def _tiles_by_definition(msa, queries, block, qt):
    """Ascending distinct ids ``block_id * (block // qt) + (pos % block) // qt`` of the queries'
    tiles, block_id the global block of the query (document's first block + pos // block)."""
    starts = torch.cumsum(torch.tensor([0, *msa.document_lengths]), 0)
    first_block, ids = 0, {}
    for doc, length in enumerate(msa.document_lengths):
        for pos in range(length):
            row = int(starts[doc]) + pos
            ids[row] = (first_block + pos // block) * (block // qt) + (pos % block) // qt
        first_block += -(-length // block)
    return sorted({ids[int(q)] for q in queries})


@pytest.mark.parametrize("seed", range(6))
def test_tile_lists_and_fields_match_their_definition(seed):
    rng = random.Random(seed)
    block = rng.choice([16, 32, 64])
    lengths = [rng.randint(1, 150) for _ in range(rng.randint(1, 4))]
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    msa = MSAMicrobatch.from_document_map(ids.view(1, -1), block_size=block)
    t = msa.num_tokens
    queries = torch.tensor(sorted(rng.sample(range(t), rng.randint(0, t))), dtype=torch.int64)
    view = kernel_layout(msa, block)
    with OpCounter() as ops:
        subset = build_query_subset(view, queries)
    sizes = [1 << i for i in range(block.bit_length()) if (1 << i) <= block]
    assert sorted(subset.tiles) == sizes
    for qt in sizes:
        tiles = subset.tile_list(qt)
        assert tiles.dtype == torch.int32 and tiles.is_contiguous()
        assert tiles.tolist() == _tiles_by_definition(msa, queries, block, qt), qt
    q = queries
    assert torch.equal(subset.token_pos, msa.document_positions[q].to(torch.int32))
    assert torch.equal(subset.token_start, view.token_start[q])
    assert subset.token_first_block.dtype == torch.int64
    row = torch.full((t,), -1, dtype=torch.int32)
    row[q] = torch.arange(q.numel(), dtype=torch.int32)
    assert torch.equal(subset.query_row, row)
    # 29 kernels whatever the block size, the one read-back of the tile counts and of the
    # queries' checks included (one list per tile size took ~11 kernels each).
    assert ops.total <= 29, ops.table()


def _csr_by_definition(q2k, msa, block, rows):
    """{(head, global block): ascending local rows whose selection names the block, once per
    slot naming it}, over valid slots (0 <= id <= own block); ``rows`` the global compact rows
    of q2k's tokens."""
    starts = torch.cumsum(torch.tensor([0, *msa.document_lengths]), 0)
    first, pos = {}, {}
    first_block = 0
    for doc, length in enumerate(msa.document_lengths):
        for p in range(length):
            first[int(starts[doc]) + p], pos[int(starts[doc]) + p] = first_block, p
        first_block += -(-length // block)
    lists: dict = {}
    for h in range(q2k.shape[0]):
        for i, row in enumerate(rows):
            for b in q2k[h, i].tolist():
                if 0 <= b <= pos[row] // block:
                    lists.setdefault((h, first[row] + b), []).append(i)
    return lists


@pytest.mark.parametrize("seed", range(3))
def test_block_query_csr_matches_its_definition_with_shared_layout_terms(seed):
    """block_query_csr keeps the layout's terms per layout view / subset (every layer of a
    microbatch shares them): two selections in a row on one layout, each against the
    definition."""
    from nemo_msa.triton.kernel_layout import block_query_csr

    rng = random.Random(seed)
    lengths = [rng.randint(1, 90) for _ in range(rng.randint(1, 3))]
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    msa = MSAMicrobatch.from_document_map(ids.view(1, -1), block_size=16)
    view = kernel_layout(msa, 16)
    t = msa.num_tokens
    queries = torch.tensor(sorted(rng.sample(range(t), rng.randint(1, t))), dtype=torch.int64)
    for subset in (None, build_query_subset(view, queries)):
        rows = list(range(t)) if subset is None else queries.tolist()
        for _ in range(2):
            q2k = torch.randint(-1, 7, (2, len(rows), 3), dtype=torch.int32)
            csr = block_query_csr(q2k, view, subset)
            want = _csr_by_definition(q2k, msa, 16, rows)
            bound = view.num_blocks_bound
            for h in range(2):
                for blk in range(bound):
                    seg = h * bound + blk
                    got = csr.tokens[csr.offsets[seg]:csr.offsets[seg + 1]].tolist()
                    assert got == want.get((h, blk), []), (h, blk)
