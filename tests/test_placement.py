"""Placement planning: demotion below high water, promotion of hot blocks, migration, never zero places."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvcluster.placement import Migration, PlacementConfig, plan_moves

CAP = {("a", "dram"): 4, ("a", "nvme"): 8, ("a", "pfs"): 100, ("b", "dram"): 4}


def apply(holdings, moves):
    """Carry the moves out the way the controller does: copy first, then drop the source."""
    state = {loc: set(ks) for loc, ks in holdings.items()}
    for m in moves:
        assert any(m.key in ks for ks in state.values()), "a move of a block held nowhere"
        if m.copy:
            state.setdefault(m.dst, set()).add(m.key)
        if m.drop_source:
            state[m.src].discard(m.key)
    return {loc: sorted(ks) for loc, ks in state.items()}


def test_a_full_tier_demotes_its_coldest_blocks_to_low_water() -> None:
    holdings = {("a", "dram"): [1, 2, 3, 4]}
    score = {1: 0.9, 2: 0.1, 3: 0.5, 4: 0.2}
    moves = plan_moves(holdings, CAP, score.get, PlacementConfig(high_water=0.7, low_water=0.5, promote_above=1.0))
    assert [(m.key, m.dst, m.reason) for m in moves] == [(2, ("a", "nvme"), "demote"), (4, ("a", "nvme"), "demote")]
    after = apply(holdings, moves)
    assert after[("a", "dram")] == [1, 3]


def test_hot_blocks_are_promoted_and_pfs_keeps_its_copy() -> None:
    holdings = {("a", "nvme"): [5], ("a", "pfs"): [6]}
    moves = plan_moves(holdings, CAP, {5: 0.9, 6: 0.8}.get, PlacementConfig(promote_above=0.6))
    by_key = {m.key: m for m in moves}
    assert by_key[5].dst == ("a", "dram") and by_key[5].drop_source
    assert by_key[6].dst == ("a", "dram") and not by_key[6].drop_source  # durable copy stays


def test_migration_copies_a_session_to_its_next_node() -> None:
    holdings = {("a", "dram"): [1, 2], ("b", "dram"): [2]}
    moves = plan_moves(holdings, CAP, lambda k: 0.0, PlacementConfig(promote_above=1.0),
                       [Migration((1, 2, 3), "b")])
    assert [(m.key, m.src, m.dst) for m in moves] == [(1, ("a", "dram"), ("b", "dram"))]


def test_a_second_round_on_the_result_moves_nothing() -> None:
    holdings = {("a", "dram"): [1, 2, 3, 4], ("a", "nvme"): [7, 8], ("a", "pfs"): [9]}
    score = {1: 0.1, 2: 0.2, 3: 0.95, 4: 0.3, 7: 0.9, 8: 0.05, 9: 0.99}
    cfg = PlacementConfig()
    after = apply(holdings, plan_moves(holdings, CAP, score.get, cfg))
    assert plan_moves(after, CAP, score.get, cfg) == []


def test_waters_are_validated() -> None:
    with pytest.raises(ValidationError, match="low_water"):
        PlacementConfig(high_water=0.5, low_water=0.6)


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(CAP)), st.lists(st.integers(0, 30), max_size=12, unique=True)),
       st.dictionaries(st.integers(0, 30), st.floats(0, 1)),
       st.lists(st.tuples(st.lists(st.integers(0, 30), max_size=5), st.sampled_from(["a", "b"])), max_size=2))
def test_no_block_is_lost_and_capacity_is_respected(holdings, scores, migrations) -> None:
    holdings = {loc: ks[: CAP[loc]] for loc, ks in holdings.items()}
    cfg = PlacementConfig()
    moves = plan_moves(holdings, CAP, lambda k: scores.get(k, 0.5), cfg,
                       [Migration(tuple(ks), node) for ks, node in migrations])
    after = apply(holdings, moves)
    before_keys = {k for ks in holdings.values() for k in ks}
    assert before_keys == {k for ks in after.values() for k in ks}  # nothing held is dropped
    for loc, ks in after.items():
        grew = len(ks) > len(holdings.get(loc, ()))
        assert not grew or len(ks) <= CAP[loc]
    assert len(moves) <= cfg.max_moves
