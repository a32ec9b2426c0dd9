"""benchmarks/gap_headroom.py's `oracle-next`: Belady over request groups, from each session's next request."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from gap_headroom import OracleNext, OracleWhen, next_session_gaps  # noqa: E402

from kvcluster.policies.base import RequestContext  # noqa: E402
from kvcluster.policies.registry import POLICIES, register  # noqa: E402
from kvcluster.simulator import PreparedTrace, TierPlan, replay  # noqa: E402


def _trace(requests: list[tuple[float, str, tuple[int, ...]]]) -> PreparedTrace:
    return PreparedTrace(name="t", block_size=16, blocks=tuple(b for _, _, b in requests),
                         types=tuple((0,) * len(b) for _, _, b in requests), transitions=(0,) * len(requests),
                         arrivals=tuple(t for t, _, _ in requests), input_tokens=(16,) * len(requests),
                         sessions=tuple(s for _, s, _ in requests),
                         unique_blocks=len({x for _, _, b in requests for x in b}))


# Three conversations, each turn re-sending its history: a returns at 10 s, b at 3 and 12 s, c never.
CONVERSATIONS = _trace([
    (0.0, "a", (1, 2)), (1.0, "b", (3, 4)), (2.0, "c", (5, 6)),
    (3.0, "b", (3, 4, 7)), (10.0, "a", (1, 2, 8)), (12.0, "b", (3, 4, 7, 9)),
])


def test_next_session_gaps_are_the_time_to_the_same_sessions_next_request():
    assert next_session_gaps(CONVERSATIONS) == [10.0, 2.0, None, 9.0, None, None]


def test_the_group_whose_session_returns_last_goes_first_deepest_block_first():
    OracleNext.gaps = next_session_gaps(CONVERSATIONS)
    oracle = OracleNext(5)
    ctx = [RequestContext(index=i, now=CONVERSATIONS.arrivals[i]) for i in range(CONVERSATIONS.requests)]
    assert oracle.access((1, 2), ctx[0]) == []
    assert oracle.access((3, 4), ctx[1]) == []
    assert oracle.access((5, 6), ctx[2]) == [6]  # c never returns: its deepest block leaves first
    assert oracle.prefix_hits((3, 4, 7)) == 2
    assert oracle.access((3, 4, 7), ctx[3]) == [5]  # then the rest of c
    assert sorted(oracle.resident()) == [1, 2, 3, 4, 7]
    oracle.check_integrity()


@pytest.fixture
def registered():
    """`oracle-next` by name for the replay, only while the test runs (other tests replay every policy)."""
    register(OracleNext)
    yield
    POLICIES.pop(OracleNext.name)


def test_on_conversations_that_own_their_blocks_it_is_belady(registered):
    OracleNext.gaps = next_session_gaps(CONVERSATIONS)
    for capacity in (2, 3, 4, 5):
        plan = [TierPlan("hbm", capacity)]
        assert replay(CONVERSATIONS, "oracle-next", plan).hit_rate == replay(CONVERSATIONS, "belady", plan).hit_rate


def test_oracle_when_keeps_a_class_for_shared_prefixes_too():
    # every block here is typed SYSTEM: each request is one shared-prefix group, in the oracle's own extra class
    OracleWhen.gaps = next_session_gaps(CONVERSATIONS)
    oracle = OracleWhen(4, refresh_requests=1)
    for i, blocks in enumerate(CONVERSATIONS.blocks):
        ctx = RequestContext(index=i, now=CONVERSATIONS.arrivals[i], block_types=CONVERSATIONS.types[i],
                             session=CONVERSATIONS.sessions[i])
        oracle.access(blocks, ctx)
        oracle.check_integrity()
    assert oracle.model.reached[oracle._shared_class][0] == sum(len(set(b)) for b in CONVERSATIONS.blocks)


def test_oracle_when_classes_a_request_s_own_blocks_by_the_true_time_to_its_session_s_next():
    """Replayed, not only asked: each group's class is the bucket of its session's true next gap (< 4 s, < 8 s,
    < 16 s, ... or never), times the transitions (all FIRST here)."""
    OracleWhen.gaps = next_session_gaps(CONVERSATIONS)  # 10, 2, never, 9, never, never
    oracle = OracleWhen(100, refresh_requests=1)
    for i, blocks in enumerate(CONVERSATIONS.blocks):
        oracle.access(blocks, RequestContext(index=i, now=CONVERSATIONS.arrivals[i], session=CONVERSATIONS.sessions[i]))
        oracle.check_integrity()
    per_bucket = 4  # transitions
    assert oracle._gcls == [2 * per_bucket, 0, 8 * per_bucket, 2 * per_bucket, 8 * per_bucket, 8 * per_bucket]
