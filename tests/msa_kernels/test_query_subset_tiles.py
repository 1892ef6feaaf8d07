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


def _random_layout(rng, block=16):
    """A layout of one row of 1-3 documents of 1-90 tokens and its kernel view."""
    lengths = [rng.randint(1, 90) for _ in range(rng.randint(1, 3))]
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    msa = MSAMicrobatch.from_document_map(ids.view(1, -1), block_size=block)
    return msa, kernel_layout(msa, block)


@pytest.mark.parametrize("seed", range(3))
def test_block_query_csr_matches_its_definition_with_shared_layout_terms(seed):
    """block_query_csr keeps the layout's terms per layout view / subset (every layer of a
    microbatch shares them): two selections in a row on one layout, each against the
    definition."""
    from nemo_msa.triton.kernel_layout import block_query_csr

    rng = random.Random(seed)
    msa, view = _random_layout(rng)
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


@pytest.mark.parametrize("seed", range(2))
def test_block_query_csr_puts_the_leading_rows_first_in_each_list(seed):
    """With a ``lead`` mask each list holds the same entries as without it: the rows of its KV
    head that lead, ascending, up to ``lead_end``, then the others, ascending; ``lead_order``
    sorts the segments by their leading sizes."""
    from nemo_msa.triton.kernel_layout import block_query_csr

    rng = random.Random(seed)
    msa, view = _random_layout(rng)
    t = msa.num_tokens
    g = torch.Generator().manual_seed(seed)
    q2k = torch.randint(-1, 7, (2, t, 3), dtype=torch.int32, generator=g)
    lead = torch.rand(2, t, generator=g) < 0.4
    csr = block_query_csr(q2k, view, lead=lead)
    want = _csr_by_definition(q2k, msa, 16, list(range(t)))
    bound = view.num_blocks_bound
    leading = []
    for h in range(2):
        for blk in range(bound):
            seg = h * bound + blk
            entries = want.get((h, blk), [])
            first = [i for i in entries if lead[h, i]]
            lo, mid, hi = csr.offsets[seg], csr.lead_end[seg], csr.offsets[seg + 1]
            assert csr.tokens[lo:mid].tolist() == first, (h, blk)
            assert csr.tokens[mid:hi].tolist() == [i for i in entries if not lead[h, i]]
            leading.append(len(first))
    sizes = torch.tensor(leading)[csr.lead_order.long()]
    assert torch.equal(sizes, sizes.sort(descending=True).values)
    assert sorted(csr.lead_order.tolist()) == list(range(2 * bound))


def test_union_rows_are_the_rows_of_tiles_with_a_small_union():
    """``HybridPlan.union_rows``: a (KV head, query row) is the union kernel's exactly when the
    distinct selected blocks of its tile (its document's queries at the same ``pos // qt``) are
    at most ``max_count`` (2 here); for the full launch and a query subset alike."""
    from nemo_msa.attention.triton_union import hybrid_plan

    seed = 0
    rng = random.Random(seed)
    block, qt = 16, 4
    lengths = [rng.randint(40, 90) for _ in range(3)]
    ids = torch.repeat_interleave(torch.arange(1, 4), torch.tensor(lengths))
    msa = MSAMicrobatch.from_document_map(ids.view(1, -1), block_size=block)
    view = kernel_layout(msa, block)
    t = msa.num_tokens
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    queries = torch.tensor(sorted(rng.sample(range(t), t // 2)), dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    own = (pos // block).view(1, t, 1)
    q2k = torch.minimum(torch.randint(-1, 5, (2, t, 3), generator=g), own).int()
    for subset in (None, build_query_subset(view, queries)):
        rows = torch.arange(t) if subset is None else queries
        sel = q2k[:, rows]
        plan = hybrid_plan(sel, view, qt, 2, 16, torch.zeros(1), subset=subset)
        got = plan.union_rows(subset or view, block, 2, subset)
        assert got.shape == (2, len(rows))
        tile = [(int(doc[r]), int(pos[r]) // qt) for r in rows.tolist()]
        for h in range(2):
            unions: dict = {}
            for i, key in enumerate(tile):
                unions.setdefault(key, set()).update(b for b in sel[h, i].tolist() if b >= 0)
            for i, key in enumerate(tile):
                assert bool(got[h, i]) == (len(unions[key]) <= 2), (h, i, unions[key])
        assert got.any() and not got.all()
