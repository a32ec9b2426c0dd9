"""Multi-tier hierarchy, prefetcher and the replay simulator on small and real traces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.block_types import BlockType, TransitionType
from kvcluster.hierarchy import Hierarchy, TierPlan
from kvcluster.keys import KeySpace
from kvcluster.policies.base import RequestContext
from kvcluster.policies.registry import make_policy, policy_names
from kvcluster.policies.bayes import describe_class
from kvcluster.simulator import prepare, replay
from kvcluster.traces.base import Trace, TraceRequest

POLICIES = ["lru", "lfu", "arc", "s3fifo", "sieve", "bayes", "bayes-v1", "belady"]


def make_trace(requests: list[list[int]], gap_s: float = 1.0) -> Trace:
    space = KeySpace()
    reqs = tuple(
        TraceRequest(
            arrival_s=i * gap_s, session=str(i), block_keys=tuple(space.chain_hash_ids(ids)),
            block_types=(BlockType.HISTORY,) * len(ids), transition=TransitionType.FIRST,
            input_tokens=16 * len(ids), output_tokens=1,
        )
        for i, ids in enumerate(requests)
    )
    return Trace(name="synthetic", format="test", block_size=16, requests=reqs)


def test_demoted_blocks_fall_to_the_next_tier_and_promote_on_hit() -> None:
    h = Hierarchy(["hbm", "dram"], [make_policy("lru", 2), make_policy("lru", 2)])
    ctx = RequestContext(0, 0.0)
    h.serve([1, 2], ctx)
    r = h.serve([3, 4], ctx)
    assert sorted(b for b, _, _ in r.demoted) == [1, 2] and h.locate(1) == 1
    r = h.serve([1, 2], ctx)
    assert r.hit_tier == (1, 1) and h.locate(1) == 0 and h.locate(2) == 0
    assert sorted(b for b, src, dst in r.demoted if (src, dst) == (0, 1)) == [3, 4]
    h.check_integrity()


def test_last_tier_drops_blocks() -> None:
    h = Hierarchy(["hbm"], [make_policy("lru", 1)])
    r = h.serve([1, 2], RequestContext(0, 0.0))
    assert r.dropped == (1,)


def test_every_registered_policy_replays() -> None:
    assert set(POLICIES) <= set(policy_names())


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 25), min_size=1, max_size=6), min_size=1, max_size=30),
    st.integers(0, 10),
    st.integers(0, 6),
)
def test_replay_invariants(requests, cap0, cap1) -> None:
    prepared = prepare(make_trace(requests))
    infinite = prepared.infinite_hit_rate()
    for policy in POLICIES:
        plan = [TierPlan("hbm", cap0), TierPlan("dram", cap1)]
        first = replay(prepared, policy, plan, check_every=1)
        again = replay(prepared, policy, plan)
        assert first.hit_rate == again.hit_rate  # deterministic
        assert first.hit_rate <= infinite + 1e-12
        big = replay(prepared, policy, [TierPlan("hbm", prepared.unique_blocks)])
        assert big.hit_rate == pytest.approx(infinite)
        deep = replay(prepared, policy, [TierPlan("hbm", cap0), TierPlan("nvme", prepared.unique_blocks)])
        assert deep.hit_rate == pytest.approx(infinite)  # nothing demoted is ever lost


def test_head_shards_count_partial_hits() -> None:
    prepared = prepare(make_trace([[1, 2, 3], [1, 2, 3]]))
    whole = replay(prepared, "bayes-v1", [TierPlan("hbm", 3)], heads=4)
    assert whole.hit_rate == pytest.approx(0.5)  # 3 of 6 refs hit, all shards present
    tight = replay(prepared, "bayes-v1", [TierPlan("hbm", 3)], heads=4, head_importance=[1, 0.5, 0.25, 0.1])
    assert tight.hit_rate == whole.hit_rate
    squeezed = prepare(make_trace([[1, 2, 3], [9], [1, 2, 3]]))
    r = replay(squeezed, "bayes-v1", [TierPlan("hbm", 3)], heads=4, head_importance=[1, 0.5, 0.25, 0.1])
    # block 9 pushed out the least important shards (of block 3 and of itself): block 3 is a partial hit
    assert r.partial_hit_rate == pytest.approx(1 / 7) and r.hit_rate == pytest.approx(2 / 7)


def test_prefetch_turns_lower_tier_hits_into_hbm_hits() -> None:
    reqs = [[1, 2, 3], [4, 5, 6], [1, 2, 3]]
    prepared = prepare(make_trace(reqs))
    plan = [TierPlan("hbm", 3), TierPlan("dram", 10)]
    cold = replay(prepared, "lru", plan)
    warm = replay(prepared, "lru", plan, prefetch_lead_s=1.5)
    assert cold.tiers[1]["hits"] == 3 and cold.tiers[0]["hits"] == 0
    assert warm.tiers[0]["hits"] == 3 and warm.prefetch["hits"] == 3 and warm.prefetch["wasted"] == 0


def test_lookahead_pins_blocks_of_queued_requests() -> None:
    prepared = prepare(make_trace([[1], [2], [3], [1]]))  # one request a second
    plan = [TierPlan("hbm", 2)]
    assert replay(prepared, "lru", plan).hit_rate == 0.0  # LRU lets 1 go just before it returns
    assert replay(prepared, "lru", plan, lookahead_s=1.5).hit_rate == 0.25  # queued: 1 stays, 2 goes
    assert replay(prepared, "lru", plan, lookahead_s=0.5).hit_rate == 0.0  # the queue is not seen that far
    with pytest.raises(ValueError, match="single tier"):
        replay(prepared, "lru", [TierPlan("hbm", 2), TierPlan("dram", 2)], lookahead_s=1.0)


def test_answers_told_after_each_request_replay_on_the_vllm_connectors_order() -> None:
    """`answers_at_finish` serves each request without how its answer ended and tells it right after, as
    vLLM's connector does. With no answers in the trace there is nothing to tell: the replay is the plain one.
    With them (a Claude Code session: tool calls and ends of turn), every tier stays consistent and the first
    tier's policy ends up with classes that name how the answers ended."""
    import dataclasses

    from data_support import require_data
    from kvcluster.traces import load_trace

    prepared = prepare(load_trace(str(require_data("weka_claude_code_traces", "trace_0017.json"))))
    plan = [TierPlan("hbm", prepared.unique_blocks // 20), TierPlan("dram", prepared.unique_blocks // 10)]
    bare = dataclasses.replace(prepared, finishes=(), output_tokens=())
    plain, told = replay(bare, "bayes", plan), replay(bare, "bayes", plan, answers_at_finish=True)
    assert (told.hit_rate, told.tiers, told.evictions) == (plain.hit_rate, plain.tiers, plain.evictions)
    seen: list = []
    replay(prepared, "bayes", plan, answers_at_finish=True, check_every=1,
           observe=lambda i, hierarchy, _: seen.append(hierarchy.policies[0]))
    finishes = {describe_class(c).get("finish") for c in seen[-1]._gcls}
    assert {"tool call", "end of turn"} <= finishes
