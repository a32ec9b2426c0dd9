"""The `bayes-hd` policy: learnt bypass of blocks that do not come back, classes, invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.block_types import BlockType, TransitionType
from kvcluster.policies.base import RequestContext
from kvcluster.policies.bayes_hd import BayesHDPolicy, class_of, describe_class


def ctx(i: int, n: int, now: float, session: str = "") -> RequestContext:
    return RequestContext(index=i, now=now, block_types=(int(BlockType.HISTORY),) * n,
                          transition=int(TransitionType.APPEND), session=session)


def test_class_layout_round_trips() -> None:
    cls = class_of(int(BlockType.TOOL), int(TransitionType.AGENT_STEP), 7, True, session=2)
    assert describe_class(cls) == {"block_type": "tool", "transition": "agent_step", "uses_before": "3+",
                                   "last_in_request": True, "session_gap": "< 64 s"}


def test_a_block_that_keeps_coming_back_outlives_streams_of_one_off_blocks() -> None:
    policy = BayesHDPolicy(capacity=4, refresh_requests=1)
    hot, fresh, hits, i = 7, 1000, 0, 0
    for step in range(200):
        if step >= 100:
            hits += policy.prefix_hits([hot])
        policy.access([hot], ctx(i, 1, 2.0 * step))
        policy.access(list(range(fresh, fresh + 4)), ctx(i + 1, 4, 2.0 * step + 1))
        fresh, i = fresh + 4, i + 2
        policy.check_integrity()
    assert hits == 100  # LRU would lose it to every batch of four
    assert policy.access([hot], ctx(i, 1, 400.0)) == []


def test_capacity_zero_holds_nothing() -> None:
    policy = BayesHDPolicy(capacity=0)
    assert sorted(policy.access([1, 2], ctx(0, 2, 0.0))) == [1, 2]
    assert len(policy) == 0
    policy.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 12), st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=40),
       st.floats(0.1, 50.0))
def test_invariants(capacity, token_runs, gap) -> None:
    ids: dict[tuple[int, ...], int] = {}
    requests = [[ids.setdefault(tuple(run[: j + 1]), len(ids)) for j in range(len(run))] for run in token_runs]
    policy = BayesHDPolicy(capacity, refresh_requests=2)
    hits = inf_hits = 0
    seen: set[int] = set()
    for i, blocks in enumerate(requests):
        hits += policy.prefix_hits(blocks)
        for b in blocks:
            if b not in seen:
                break
            inf_hits += 1
        seen.update(blocks)
        evicted = policy.access(blocks, ctx(i, len(blocks), i * gap, session=str(i % 3)))
        assert len(policy) <= capacity and all(b not in policy for b in evicted)
        assert len(evicted) == len(set(evicted))
        policy.check_integrity()
    assert hits <= inf_hits
