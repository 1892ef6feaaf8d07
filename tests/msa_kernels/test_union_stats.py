"""benchmarks/msa_bench/unions.py (the hybrid schedule's split of a selection, ADR 0031; read by
benchmarks/indexer_regime.py and the layer bench) against brute force on random selections with
padding and packed documents."""

from __future__ import annotations

import pytest
import torch
from msa_bench.unions import hybrid_work, tile_union_sizes

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)


def _brute(q2k, documents, positions, qt):
    """Tiles as python lists: (union per head, tokens, exact per head) in first-token order."""
    tiles: dict[tuple[int, int], list[int]] = {}
    for t in range(q2k.shape[1]):
        tiles.setdefault((int(documents[t]), int(positions[t]) // qt), []).append(t)
    out = []
    for members in tiles.values():
        union = [len({int(b) for t in members for b in q2k[h, t] if b >= 0})
                 for h in range(q2k.shape[0])]
        exact = [sum(int((q2k[h, t] >= 0).sum()) for t in members) for h in range(q2k.shape[0])]
        out.append((union, len(members), exact))
    return out


@pytest.mark.parametrize("qt", [1, 2, 3, 8])
def test_tile_unions_match_brute_force(qt):
    gen = torch.Generator().manual_seed(qt)
    lengths = [5, 17, 1, 9]  # packed documents, a partial last tile in most of them
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    q2k = torch.randint(-1, 6, (2, len(documents), 4), generator=gen, dtype=torch.int32)
    union, tokens, exact = tile_union_sizes(q2k, documents, positions, qt)
    expected = _brute(q2k, documents, positions, qt)
    assert union.shape == (2, len(expected)) and exact.shape == union.shape
    assert tokens.tolist() == [n for _, n, _ in expected]
    assert union.T.tolist() == [u for u, _, _ in expected]
    assert exact.T.tolist() == [e for _, _, e in expected]


def test_hybrid_work_splits_at_the_cap():
    union = torch.tensor([[2, 5, 3]])
    tokens = torch.tensor([2, 2, 1])
    exact = torch.tensor([[3, 4, 2]])
    w = hybrid_work(union, tokens, exact, cap=3)  # tiles 0 and 2 take the union kernel
    assert w["union_tiles"] == pytest.approx(2 / 3)
    assert w["union_exact_share"] == pytest.approx(5 / 9)
    assert w["union_inflation"] == pytest.approx((2 * 2 + 3 * 1) / 5)
    assert hybrid_work(union, tokens, exact, cap=1)["union_tiles"] == 0.0


def test_bad_arguments():
    q2k = torch.zeros((1, 4, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="qt=0: expected >= 1"):
        tile_union_sizes(q2k, torch.zeros(4), torch.arange(4), 0)
    with pytest.raises(ValueError, match=r"expected \[4\] like q2k's tokens"):
        tile_union_sizes(q2k, torch.zeros(3), torch.arange(4), 2)
