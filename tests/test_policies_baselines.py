"""LRU, LFU, ARC, S3-FIFO, SIEVE and Belady: exact eviction orders, invariants, published reference numbers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.errors import ConfigError
from kvcluster.policies import FAR, RequestContext, make_policy
from kvcluster.hierarchy import TierPlan
from kvcluster.simulator import prepare, replay
from kvcluster.traces import load_trace

from data_support import require_data

CTX = RequestContext(0, 0.0)
ONLINE = ["lru", "lfu", "arc", "s3fifo", "sieve", "bayes", "bayes-v1"]


def evictions(policy: str, seq: list[int], capacity: int) -> list[int]:
    p = make_policy(policy, capacity)
    out: list[int] = []
    for b in seq:
        out += p.access([b], CTX)
        p.check_integrity()
    return out


def test_lru_order() -> None:
    assert evictions("lru", [1, 2, 3, 1, 4, 5], 3) == [2, 3]


def test_lfu_order_breaks_ties_by_recency() -> None:
    assert evictions("lfu", [1, 1, 2, 3, 4, 2, 5], 3) == [2, 3, 4]


def test_s3fifo_one_hit_wonders_leave_through_the_small_queue() -> None:
    # capacity 10: small queue 1; block 1 is reused while in the small queue and survives a scan
    out = evictions("s3fifo", [1, 1] + list(range(2, 20)), 10)
    assert 1 not in out and out[:3] == [2, 3, 4]


def test_arc_keeps_frequent_blocks_through_a_scan() -> None:
    out = evictions("arc", [1, 2, 1, 2, 3, 4, 5, 6], 3)
    assert 1 not in out and 2 not in out[:2] and out[:2] == [3, 4]


def test_belady_breaks_ties_towards_the_deepest_block() -> None:
    p = make_policy("belady", 2)
    assert p.access([1, 2, 3], RequestContext(0, 0.0, next_use=[1, 1, 1])) == [3]


def test_belady_evicts_the_farthest_next_use() -> None:
    p = make_policy("belady", 2)
    assert p.access([1, 2], RequestContext(0, 0.0, next_use=[5, 1])) == []
    assert p.access([3], RequestContext(1, 0.0, next_use=[2])) == [1]
    assert p.access([2], RequestContext(2, 0.0, next_use=[FAR])) == []
    assert p.access([4], RequestContext(3, 0.0, next_use=[4])) == [2]


def test_sieve_order() -> None:
    # cap 3: a hit only marks 1; the hand passes it (clearing the mark) and takes 2, then 3, 4;
    # 5 is marked, so the hand takes 6 next to it, and then, from the tail again, 5 (its mark was cleared)
    assert evictions("sieve", [1, 2, 3, 1, 4, 5, 1, 6, 5, 7, 8], 3) == [2, 3, 4, 6, 5]


def test_sieve_keeps_the_hand_and_does_not_move_survivors() -> None:
    p = make_policy("sieve", 3)
    for b in (1, 2, 3):
        p.access([b], CTX)
    p.access([1], CTX)
    assert p.access([4], CTX) == [2]
    assert p.order() == [1, 3, 4]  # 1 survived in place, at the tail
    p.check_integrity()


def test_sieve_brings_a_request_in_tail_first_so_its_prefix_outlives_it() -> None:
    p = make_policy("sieve", 4)
    p.access([1, 2, 3], CTX)
    assert p.order() == [3, 2, 1]
    assert p.access([4, 5], CTX) == [3]  # the suffix of the older chain, not its head
    p.check_integrity()


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'mru'"):
        make_policy("mru", 3)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(ONLINE), st.integers(0, 8),
       st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=5, unique=True), max_size=30))
def test_capacity_admit_discard_integrity(name, capacity, requests) -> None:
    p = make_policy(name, capacity)
    for i, blocks in enumerate(requests):
        evicted = p.access(blocks, RequestContext(i, float(i)))
        assert len(p) <= capacity and not any(b in p for b in evicted)
        p.admit([b + 100 for b in blocks], RequestContext(i, float(i)))
        p.discard(blocks[:1])
        assert blocks[0] not in p
        p.check_integrity()
        assert set(p.resident()) == {b for b in range(200) if b in p}


@pytest.mark.slow
def test_mooncake_reference_numbers() -> None:
    path = require_data("mooncake", "synthetic_trace.jsonl")
    trace = prepare(load_trace(str(path)))
    assert trace.unique_blocks == 43_924 and round(0.05 * trace.unique_blocks) == 2196
    assert trace.infinite_hit_rate() == pytest.approx(0.640, abs=5e-4)
    plan = [TierPlan("hbm", 2196)]
    assert replay(trace, "lru", plan).hit_rate == pytest.approx(0.155, abs=5e-4)
    assert replay(trace, "belady", plan, policy_options={"tie_break": "id"}).hit_rate == pytest.approx(0.386, abs=5e-4)
    bound = replay(trace, "belady", plan).hit_rate
    assert bound == pytest.approx(0.3956, abs=5e-4)  # prefix-aware ties: a tighter bound
    for name in ONLINE:
        assert replay(trace, name, plan).hit_rate < bound
