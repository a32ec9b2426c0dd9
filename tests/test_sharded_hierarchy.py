"""The manager state split by key hash: shares of every tier, blocks kept in their own shard, the prefix
run counted across shards, and the same decisions as N separate hierarchies fed their own blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.policies.base import RequestContext
from kvcluster.sharded_hierarchy import ShardedHierarchy, shard_capacities, split_blocks
from kvcluster.simulator import TierPlan, build_hierarchy, prepare, replay, sharded_hierarchy
from kvcluster.traces import load_trace

from data_support import require_data


def test_shares_add_up_to_the_tier_and_a_tier_too_small_is_refused() -> None:
    assert shard_capacities(10, 3) == [4, 3, 3] and shard_capacities(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="cannot be split over 3"):
        shard_capacities(2, 3)


def test_split_keeps_request_order_within_each_shard() -> None:
    assert split_blocks([5, 2, 7, 4, 1], lambda b: b % 2) == {1: [5, 7, 1], 0: [2, 4]}


def test_a_hit_counts_only_inside_the_run_across_shards() -> None:
    """Shard 0 (even blocks) holds 2 and 4; shard 1 (odd) holds nothing: serving [2, 3, 4] hits block 2
    only, though shard 0 also holds 4 (past the miss at 3)."""
    h = ShardedHierarchy([build_hierarchy("lru", [TierPlan("dram", 4)]) for _ in range(2)], lambda b: b % 2)
    h.serve([2, 4], RequestContext(index=0, now=0.0))
    result = h.serve([2, 3, 4], RequestContext(index=1, now=1.0))
    assert result.hit_tier == (0,)
    assert 3 in h.shards[1].policies[0] and 3 not in h.shards[0].policies[0]
    h.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=8), min_size=1, max_size=40),
       st.sampled_from(["lru", "arc", "s3fifo", "bayes"]), st.integers(2, 4))
def test_each_shard_decides_as_a_hierarchy_fed_only_its_blocks(requests, policy, shards) -> None:
    plan = [TierPlan("dram", 2 * shards), TierPlan("nvme", 3 * shards)]
    h = sharded_hierarchy(policy, plan, shards)
    alone = [build_hierarchy(policy, [TierPlan(t.name, c) for t, c in zip(plan, [2, 3])]) for _ in range(shards)]
    for i, blocks in enumerate(requests):
        blocks = list(dict.fromkeys(blocks))
        ctx = RequestContext(index=i, now=float(i))
        h.serve(blocks, ctx)
        for s, sub in split_blocks(blocks, h.shard_of).items():
            alone[s].serve(sub, ctx)
    h.check_integrity()
    for mine, ref in zip(h.shards, alone):
        assert [sorted(p.resident()) for p in mine.policies] == [sorted(p.resident()) for p in ref.policies]


def test_one_shard_replays_exactly_as_no_sharding() -> None:
    trace = prepare(load_trace(str(require_data("mooncake", "synthetic_trace.jsonl")), max_records=300))
    plan = [TierPlan("dram", trace.unique_blocks // 50), TierPlan("nvme", trace.unique_blocks // 20)]
    one, none = replay(trace, "lru", plan, control_shards=1), replay(trace, "lru", plan)
    assert one.tiers == none.tiers and one.hit_rate == none.hit_rate
