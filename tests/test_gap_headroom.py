"""benchmarks/gap_headroom.py's oracles: `oracle-next` (Belady over request groups, from each session's next
request), `oracle-pace` (the same from each session's pace) and `oracle-when`."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from gap_headroom import (FittedOnline, OracleNext, OraclePace, OracleWhen, fitted_cure_rates,  # noqa: E402
                          next_session_gaps, online_classes, session_gap_stats, session_paces)

from kvcluster.policies.base import RequestContext  # noqa: E402
from kvcluster.policies.registry import POLICIES, register  # noqa: E402
from kvcluster.hierarchy import TierPlan  # noqa: E402
from kvcluster.simulator import PreparedTrace, replay  # noqa: E402


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


def test_session_paces_are_the_mean_time_between_the_sessions_later_requests():
    assert session_paces(CONVERSATIONS) == [10.0, 5.5, None, 9.0, None, None]


# x comes back at once, then only after a long while; y once, in between.
PACES = _trace([(0.0, "x", (1, 2)), (0.5, "y", (3, 4)), (1.0, "x", (1, 2, 5)), (20.0, "y", (3, 4, 6)),
                (100.0, "x", (1, 2, 5, 7))])


def test_the_next_request_keeps_what_the_pace_lets_go():
    OracleNext.gaps = next_session_gaps(PACES)
    OraclePace.paces = session_paces(PACES)
    assert OraclePace.paces == [50.0, 19.5, 99.0, None, None]
    ctx = [RequestContext(index=i, now=PACES.arrivals[i]) for i in range(PACES.requests)]
    by_next, by_pace = OracleNext(3), OraclePace(3)
    for oracle in (by_next, by_pace):
        assert oracle.access((1, 2), ctx[0]) == []
    assert by_next.access((3, 4), ctx[1]) == [4]  # x is back at 1 s, y only at 20 s
    assert by_pace.access((3, 4), ctx[1]) == [2]  # but y's pace (19.5 s) is faster than x's (50 s)
    for oracle in (by_next, by_pace):
        oracle.check_integrity()


def test_session_gap_stats_measure_how_random_a_sessions_waits_are():
    stats = session_gap_stats(CONVERSATIONS, min_requests=3)  # only b has 3 requests: gaps of 2 and 9 s
    assert stats["sessions"] == 1 and stats["median_cv"] == pytest.approx(3.5 / 5.5)
    assert stats["gaps"] == 1 and stats["corr_known_next"] is None  # one pair: no correlation to speak of
    steady = _trace([(float(t), "s", (1,)) for t in (0, 10, 20, 30, 40, 50)])
    assert session_gap_stats(steady)["median_cv"] == 0.0


def test_online_classes_hold_a_first_requests_lengths_and_a_later_ones_turn_and_pace():
    trace = dataclasses.replace(CONVERSATIONS, input_tokens=(100, 2000, 20000, 50, 50, 50),
                                output_tokens=(10, 100, 0, 300, 5, 5))
    # a: first, < 1,024 prompt tokens, answer < 32; b: 1,024-4,095, < 256; c: >= 16,384, unknown answer;
    # b's 2nd turn after 2 s (pace < 8 s); a's 2nd after 10 s (< 64 s); b's 3rd, gaps 2 and 9 s (mean 4.2 s)
    assert online_classes(trace) == [1, 6, 12, 16, 20, 16 + 3 * 4]
    rates = fitted_cure_rates([0, 0, 1, 0], [10.0, None, None, 30.0])
    assert rates == {0: (2 / 3, 2 / 40.0), 1: (0.0, 1.0)}


def test_fitted_online_ranks_by_its_cure_rate_hazards():
    FittedOnline.classes = [0, 1, 0, 1, 0, 1]
    FittedOnline.rates = {0: (1.0, 0.5), 1: (0.0, 1.0)}  # class 0 always back, class 1 never
    policy = FittedOnline(5, refresh_requests=1)
    for i, blocks in enumerate(CONVERSATIONS.blocks[:3]):
        policy.access(blocks, RequestContext(index=i, now=CONVERSATIONS.arrivals[i], session=CONVERSATIONS.sessions[i]))
    assert policy._dens[0][0] == pytest.approx(0.5) and policy._dens[1] == [0.0] * len(policy._dens[1])
    assert sorted(policy.resident()) == [1, 2, 3, 5, 6]  # b's class never comes back: its deepest block went
    policy.check_integrity()


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


def test_the_informed_oracle_knows_whether_a_session_returns_and_the_clock_s_hazard_not_the_draw():
    from informed_oracle import OracleInformed, bin_hazards, sessions_returning, think_time_cdf

    from kvcluster.reuse_gap import GapModel
    from kvcluster.traces import TraceClock

    assert sessions_returning(CONVERSATIONS.sessions) == [True, True, False, True, False, False]
    edges = GapModel(1).edges
    fixed = bin_hazards(think_time_cdf(TraceClock(fixed=True)), edges)
    assert fixed.count(1.0) >= 1 and fixed[:fixed.index(1.0)] == [0.0] * fixed.index(1.0)  # all come back at 30 s
    hazards = bin_hazards(think_time_cdf(TraceClock()), edges)
    cdf, survive = think_time_cdf(TraceClock()), 1.0
    for k, h in enumerate(hazards):  # the chance to wait until bin k, then end in it, is the clock's mass there
        hi = cdf(edges[k + 1]) if k + 1 < len(edges) else 1.0
        assert survive * h == pytest.approx(hi - cdf(edges[k]), abs=1e-12)
        survive *= 1.0 - h
    assert survive == pytest.approx(0.0, abs=1e-9) and hazards[-1] == 1.0  # every returning session returns
    if OracleInformed.name not in POLICIES:
        register(OracleInformed)
    OracleInformed.returns = sessions_returning(CONVERSATIONS.sessions)
    got = replay(CONVERSATIONS, "oracle-informed", [TierPlan("hbm", 5)])
    assert 0.0 <= got.hit_rate <= replay(CONVERSATIONS, "belady", [TierPlan("hbm", 5)]).hit_rate
