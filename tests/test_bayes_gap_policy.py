"""The `bayes` policy: learnt bypass, newest-first eviction of classes that come back after a gap,
prefix-closed requests, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.block_types import BlockType, TransitionType
from policy_support import check_invariants
from kvcluster.policies.base import RequestContext
from kvcluster.policies.bayes import (CLASSES, REQUEST_CLASSES, SHARED_PREFIX, BayesPolicy, answer_bucket, class_of,
                                      describe_class, finish_index, session_bucket, shared_lead)


def ctx(i: int, n: int, now: float, session: str = "", transition=TransitionType.APPEND,
        finish: str = "", output_tokens: int = 0) -> RequestContext:
    return RequestContext(index=i, now=now, block_types=(int(BlockType.HISTORY),) * n,
                          transition=int(transition), session=session, finish=finish, output_tokens=output_tokens)


def test_class_layout_round_trips() -> None:
    cls = class_of(int(TransitionType.AGENT_STEP), session=2)
    assert describe_class(cls) == {"transition": "agent_step", "session_gap": "< 64 s", "finish": "unknown",
                                   "first_answer": "unknown"}
    assert describe_class(class_of(1, 3, finish_index("tool_calls")))["finish"] == "tool call"
    assert describe_class(class_of(0, 0, 2, answer_bucket(31)))["first_answer"] == "< 32 tokens"
    assert [finish_index(f) for f in ("tool_use", "tool_calls", "end_turn", "stop", "length", "")] == [1, 1, 2, 2, 0, 0]
    assert [finish_index("tool_use", n) for n in (0, 511, 512)] == [1, 1, 3]  # a long tool call is a finish of its own
    assert finish_index("end_turn", 5000) == 2 and finish_index("", 5000) == 0
    assert describe_class(class_of(1, 3, finish_index("tool_use", 600)))["finish"] == "long tool call"
    assert [answer_bucket(n) for n in (0, 1, 31, 32, 255, 256)] == [0, 1, 1, 2, 2, 3]
    assert sorted(class_of(t, s, f, a) for t in range(4) for s in range(4) for f in range(4)
                  for a in range(4)) == list(range(REQUEST_CLASSES)) and REQUEST_CLASSES == 256
    assert describe_class(SHARED_PREFIX) == {"shared_prefix": True} and CLASSES == 257


def test_how_an_answer_ended_tells_a_quick_return_from_a_long_wait() -> None:
    # The same transition and session gaps: after a tool call the session is back in 3 s, after the end of
    # a turn it is not back within the minute. Only the finish reason tells the two apart.
    policy = BayesPolicy(capacity=10_000, refresh_requests=1)
    i, now = 0, 0.0
    for k in range(60):
        tool, done = f"tool{k}", f"done{k}"
        for session, finish in ((tool, "tool_use"), (done, "end_turn")):
            policy.access([hash((session, 0))], ctx(i, 1, now, session=session, finish=finish))
            i, now = i + 1, now + 0.1
        now += 3.0
        policy.access([hash((tool, 0))], ctx(i, 1, now, session=tool, finish="end_turn"))
        i, now = i + 1, now + 120.0
    after_tool, after_turn = (policy.predict_within([1], ctx(i, 1, now, session="new", finish=f), 10.0)[0]
                              for f in ("tool_use", "end_turn"))
    assert after_tool > 0.9 and after_turn < 0.1


def test_a_long_tool_call_comes_back_later_than_a_short_one() -> None:
    # Both end in a tool call; the short call's result is back in 3 s, the long one's (a file written, a long
    # command) after 40 s. The answer's length is what tells them apart.
    policy = BayesPolicy(capacity=10_000, refresh_requests=1)
    i, now = 0, 0.0
    for k in range(60):
        short, long = f"short{k}", f"long{k}"
        for session, out in ((short, 100), (long, 2000)):
            policy.access([hash((session, 0))], ctx(i, 1, now, session=session, finish="tool_use", output_tokens=out))
            i, now = i + 1, now + 0.1
        for session, back in ((short, 3.0), (long, 37.0)):
            now += back
            policy.access([hash((session, 0))], ctx(i, 1, now, session=session, finish="end_turn"))
            i += 1
        now += 120.0
    quick, slow = (policy.predict_within([1], ctx(i, 1, now, session="new", finish="tool_use", output_tokens=out),
                                         10.0)[0] for out in (100, 2000))
    assert quick > 0.9 and slow < 0.1


def test_a_block_that_keeps_coming_back_outlives_streams_of_one_off_blocks() -> None:
    policy = BayesPolicy(capacity=4, refresh_requests=1)
    hot, fresh, hits, i = 7, 1000, 0, 0
    for step in range(200):
        if step >= 100:
            hits += policy.prefix_hits([hot])
        policy.access([hot], ctx(i, 1, 2.0 * step, session="hot"))
        policy.access(list(range(fresh, fresh + 4)), ctx(i + 1, 4, 2.0 * step + 1, transition=TransitionType.FIRST))
        fresh, i = fresh + 4, i + 2
        policy.check_integrity()
    assert hits == 100  # LRU would lose it to every batch of four


def test_conversations_that_return_after_a_fixed_gap_are_kept_newest_out() -> None:
    # 6 conversations in turn, each back 30 s after its last turn; the cache holds two of them.
    # LRU always evicts the one coming back next and never hits; the policy learns the gap and
    # lets the freshest conversation go instead, so the older ones stay until they return.
    policy = BayesPolicy(capacity=8, refresh_requests=1)
    hits = total = 0
    for turn in range(40):
        for conv in range(6):
            blocks = [conv * 1000 + k for k in range(4)]
            if turn >= 20:
                hits += policy.prefix_hits(blocks)
                total += len(blocks)
            policy.access(blocks, ctx(turn * 6 + conv, 4, turn * 30.0 + conv * 5.0, session=str(conv)))
            policy.check_integrity()
    assert hits == total // 3  # every turn the two conversations it kept come back: 2 of 6 served from cache


def test_fresh_groups_let_go_at_once_do_not_shorten_the_horizon() -> None:
    # Conversations start 5 s apart, each of 1-10 turns 30 s apart, every turn 8 new blocks on its context;
    # the cache holds 2% of them. The policy lets the freshest turns go (they wait 30 s) and keeps the ones due
    # soon. Were those fresh victims' ages (about 0 s) taken for how long a block lasts, the horizon would fall
    # under one turn gap, the return at 30 s would drop out of the densities and the bypass would run away.
    turns, block = [], 0
    for conv in range(300):
        context: list[int] = []
        for turn in range(1 + conv * 7 % 10):
            context = context + list(range(block, block + 8))
            block += 8
            turns.append((conv * 5.0 + turn * 30.0, str(conv), context, TransitionType.APPEND if turn else
                          TransitionType.FIRST))
    turns.sort(key=lambda t: t[0])
    policy = BayesPolicy(capacity=round(0.02 * block))
    hits = total = 0
    horizons = []
    for i, (now, session, blocks, transition) in enumerate(turns):
        hits += policy.prefix_hits(blocks)
        total += len(blocks)
        policy.access(blocks, ctx(i, len(blocks), now, session=session, transition=transition))
        if i >= len(turns) // 4:
            horizons.append(policy.horizon_s)
    assert min(horizons) >= 6 * 30.0  # 6x how long a kept group lasts, which is at least one turn gap
    assert hits >= 0.16 * total  # 0.1326 when the fresh victims counted


def test_the_horizon_is_never_shorter_than_the_time_the_cache_takes_to_fill() -> None:
    # 20 one-off requests of 5 new blocks, 1 s apart, into 10 blocks: from the third on, each evicts a group
    # 0-2 s old. 100 blocks entered in 19 s, so the cache fills in 10 x 19 / 100 = 1.9 s: the horizon counts
    # at least 6 x 1.9 s, whatever the victims' ages say (their mean is the policy's own doing: were it to let
    # every fresh group go at once, it would fall towards 0 s).
    policy = BayesPolicy(capacity=10)
    assert policy.fill_time_s == 0.0 and policy.horizon_s == 0.0
    for i in range(20):
        policy.access(list(range(5 * i, 5 * i + 5)), ctx(i, 5, float(i), session=f"s{i}"))
    assert policy.fill_time_s == pytest.approx(1.9)
    assert policy.horizon_s == pytest.approx(6 * 1.9)


def test_a_request_leaves_deepest_first() -> None:
    policy = BayesPolicy(capacity=6)
    policy.access([1, 2, 3, 4, 5], ctx(0, 5, 0.0, session="a"))
    policy.access([9, 10], ctx(1, 2, 1.0, session="b"))
    kept = [b in policy for b in (1, 2, 3, 4, 5)]
    assert kept == sorted(kept, reverse=True)  # what is left of the first request is a prefix
    policy.check_integrity()


def test_capacity_zero_holds_nothing() -> None:
    policy = BayesPolicy(capacity=0)
    assert sorted(policy.access([1, 2], ctx(0, 2, 0.0))) == [1, 2]
    assert len(policy) == 0
    policy.check_integrity()


GHOSTS = st.sampled_from([None, 0, 1, 5])  # None: the default bound; k: k ghosts kept after each sweep


def bounded(capacity: int, ghosts: int | None) -> BayesPolicy:
    if ghosts is None:
        return BayesPolicy(capacity, refresh_requests=2)
    return BayesPolicy(capacity, refresh_requests=2, ghost_factor=0.0, min_ghosts=ghosts, min_groups=ghosts)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 12), st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=40),
       st.floats(0.1, 50.0), GHOSTS)
def test_invariants(capacity, token_runs, gap, ghosts) -> None:
    check_invariants(bounded(capacity, ghosts), capacity, token_runs,
                     lambda i, blocks: ctx(i, len(blocks), i * gap, session=str(i % 3)))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 12), st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=40),
       st.floats(0.1, 50.0), st.integers(0, 4), GHOSTS)
def test_invariants_with_shared_prefixes(capacity, token_runs, gap, lead, ghosts) -> None:
    # the first `lead` blocks of every request are a shared prefix: a group of its own, tied to the rest
    def typed(i, blocks):
        types = [int(BlockType.SYSTEM)] * min(lead, len(blocks)) + [int(BlockType.HISTORY)] * max(0, len(blocks) - lead)
        return RequestContext(index=i, now=i * gap, block_types=types, transition=int(TransitionType.APPEND),
                              session=str(i % 3))
    check_invariants(bounded(capacity, ghosts), capacity, token_runs, typed)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 8), st.lists(st.tuples(st.sampled_from(["access", "more", "admit", "discard", "answered"]),
                                             st.lists(st.integers(0, 30), min_size=1, max_size=6)), max_size=50),
       GHOSTS)
def test_admissions_and_discards_keep_the_ghosts_and_groups_consistent(capacity, ops, ghosts) -> None:
    policy = bounded(capacity, ghosts)
    for i, (op, blocks) in enumerate(ops):
        blocks = list(dict.fromkeys(blocks))
        if op == "discard":
            policy.discard(blocks)
        elif op == "answered":  # told late, whatever happened to the blocks meanwhile
            policy.answered(str(blocks[0] % 2), ("end_turn", "tool_use", "")[blocks[0] % 3], 10 * blocks[-1])
        elif op == "more":  # a later part of the session's latest request
            policy.access(blocks, RequestContext(index=i, now=3.0 * i, session=str(i % 2), continues=True))
        else:
            getattr(policy, op)(blocks, ctx(i, len(blocks), 3.0 * i, session=str(i % 2)))
        assert len(policy) <= capacity
        policy.check_integrity()


def test_memory_stays_bounded_as_blocks_keep_coming() -> None:
    # 20,000 requests of new blocks: what is kept is the resident set plus at most twice the ghosts kept
    policy = BayesPolicy(capacity=10, ghost_factor=4.0, min_ghosts=0, min_groups=16)
    for i in range(20_000):
        policy.access([3 * i, 3 * i + 1, 3 * i + 2], ctx(i, 3, float(i), session=str(i % 7)))
        assert len(policy._last) <= 10 + 2 * 40
        assert policy.groups_tracked <= 2 * max(16, 10 + 2 * 40) + 32  # compacted at twice what was kept
    policy.check_integrity()


def test_a_cache_holding_its_whole_working_set_keeps_no_group_per_request() -> None:
    # nothing is ever evicted: every request hits, and each one's group takes the blocks over from the last
    policy = BayesPolicy(capacity=100, min_groups=8)  # compacted at the refresh (every 32 requests) after 16 groups
    for i in range(5_000):
        policy.access([1, 2, 3, 4 + i % 3], ctx(i, 4, float(i), session="s"))
        assert policy.groups_tracked <= 2 * 8 + 32
    assert sum(len(members) for members in policy._gblocks.values()) <= 4 * (2 * 8 + 32)
    policy.check_integrity()


def test_a_remembered_block_returns_as_a_reuse_and_a_forgotten_one_as_new() -> None:
    policy = BayesPolicy(capacity=1, ghost_factor=0.0, min_ghosts=2)
    for i in range(6):  # one new block per request: at the fifth that left, a sweep keeps the newest two
        policy.access([i], ctx(i, 1, float(i)))
    known = set(policy._last)
    ghosts = {b for b in known if b not in policy}
    forgotten = set(range(6)) - known
    assert len(known) == 3 and len(ghosts) == 2 and min(ghosts) > max(forgotten)
    reused = sum(map(sum, policy.model.reused))
    policy.access([min(ghosts)], ctx(6, 1, 6.0))  # remembered: a reuse
    assert sum(map(sum, policy.model.reused)) == reused + 1
    policy.access([min(forgotten)], ctx(7, 1, 7.0))  # forgotten: new
    assert sum(map(sum, policy.model.reused)) == reused + 1
    policy.check_integrity()


def test_a_block_admitted_with_no_use_known_here_is_not_reused_at_its_first_use() -> None:
    policy = BayesPolicy(capacity=8)
    policy.access([1, 2], ctx(0, 2, 0.0))
    policy.admit([3, 4], ctx(1, 0, 5.0))  # read from elsewhere: arrived, never used here
    reused = sum(map(sum, policy.model.reused))
    policy.access([3, 4, 5], ctx(2, 3, 6.0))
    assert sum(map(sum, policy.model.reused)) == reused  # their gap would be the 1 s since they arrived
    policy.access([1, 3], ctx(3, 2, 9.0))  # used here since: reuses, both
    assert sum(map(sum, policy.model.reused)) == reused + 2
    policy.check_integrity()


def test_shared_lead_counts_the_leading_system_blocks_of_any_sequence() -> None:
    import numpy as np
    S, H = int(BlockType.SYSTEM), int(BlockType.HISTORY)
    for kind in (tuple, list, lambda t: np.array(t, dtype=np.int64)):
        assert shared_lead(kind((S, S, H, S)), 4) == 2
        assert shared_lead(kind((S, S, S)), 2) == 2  # only the request's first n blocks
        assert shared_lead(kind((H, S)), 2) == 0
    assert shared_lead((), 3) == 0


def system_ctx(i: int, session: str, now: float, shared: int, n: int, finish: str = "end_turn") -> RequestContext:
    types = (int(BlockType.SYSTEM),) * shared + (int(BlockType.HISTORY),) * (n - shared)
    return RequestContext(index=i, now=now, block_types=types, transition=int(TransitionType.FIRST), session=session,
                          finish=finish)


def test_a_shared_prefix_is_classed_apart_from_the_sessions_that_use_it() -> None:
    # Every 5 s a new session asks on the same 2-block system prompt and never comes back: the prompt is reused
    # within seconds, each session's own blocks never. One class per request would give both the same figure.
    policy = BayesPolicy(capacity=10_000, refresh_requests=1)
    for k in range(80):
        policy.access([1, 2] + [1000 + 10 * k + j for j in range(3)], system_ctx(k, f"s{k}", 5.0 * k, 2, 5))
    p = policy.predict_within([1, 2, 7, 8, 9], system_ctx(80, "new", 400.0, 2, 5), 10.0)
    assert p[0] == p[1] > 0.9 and p[2] == p[3] == p[4] < 0.1


def test_each_request_group_is_one_observation_of_its_class() -> None:
    # 80 requests of 2 shared + 3 own blocks: 80 groups of 2 in the shared class, 80 groups of 3 in the
    # sessions' class. A block repeated within a request counts once and makes no group of its own.
    policy = BayesPolicy(capacity=10_000)
    for k in range(80):
        policy.access([1, 2] + [1000 + 10 * k + j for j in range(3)], system_ctx(k, f"s{k}", 5.0 * k, 2, 5))
    own = policy._session_class(system_ctx(0, "new", 0.0, 2, 5), remember=False)
    model = policy.model
    assert (model.groups[SHARED_PREFIX], model.reached[SHARED_PREFIX][0]) == (80, 160)
    assert (model.groups[own], model.reached[own][0]) == (80, 240) and sum(model.groups) == 160
    policy.access([5, 5, 6], ctx(80, 3, 500.0, session="t"))
    assert sum(model.groups) == 161 and sum(row[0] for row in model.reached) == 402


def test_a_request_s_own_blocks_leave_before_the_shared_prefix_they_hang_on() -> None:
    # Sessions on one system prompt, each back once 30 s later; the cache holds less than one request. Whatever
    # the classes' densities say, a request's own blocks never outlive the shared prefix they follow.
    policy = BayesPolicy(capacity=5, refresh_requests=1)
    i, now = 0, 0.0
    for k in range(40):
        blocks = [1, 2] + [1000 + 10 * k + j for j in range(4)]
        for extra, finish in ((0, "tool_use"), (1, "end_turn")):
            policy.access(blocks + [1005 + 10 * k] * extra, system_ctx(i, f"s{k}", now, 2, 6 + extra, finish))
            resident = [b in policy for b in blocks]
            assert resident == sorted(resident, reverse=True)
            policy.check_integrity()
            i, now = i + 1, now + 30.0


def test_a_first_answer_s_length_tells_a_conversation_that_goes_on_from_one_that_ends() -> None:
    # New conversations whose first answer is short come back 20 s later; those with a long answer never do.
    policy = BayesPolicy(capacity=10_000, refresh_requests=1)
    i, now = 0, 0.0
    for k in range(60):
        for session, out in ((f"short{k}", 10), (f"long{k}", 500)):
            policy.access([hash((session, 0))], ctx(i, 1, now, session=session, transition=TransitionType.FIRST,
                                                    output_tokens=out))
            i, now = i + 1, now + 0.1
        now += 20.0
        policy.access([hash((f"short{k}", 0)), hash((f"short{k}", 1))], ctx(i, 2, now, session=f"short{k}"))
        i, now = i + 1, now + 100.0
    short, long = (policy.predict_within([1], ctx(i, 1, now, session="new", transition=TransitionType.FIRST,
                                                  output_tokens=out), 32.0)[0] for out in (10, 500))
    assert short > 0.9 and long < 0.1
    # a later turn's answer length does not split its class
    policy._session_class(ctx(i, 1, now, session="s"), True)
    assert (policy._session_class(ctx(i, 1, now + 5.0, session="s", output_tokens=10), False)
            == policy._session_class(ctx(i, 1, now + 5.0, session="s", output_tokens=500), False))
    # a session's first request is its first whatever its transition: a FORK on a shared system prompt too
    forks = [policy._session_class(ctx(i, 1, now, session="t", transition=TransitionType.FORK, output_tokens=out),
                                   False) for out in (10, 500)]
    assert [describe_class(c)["first_answer"] for c in forks] == ["< 32 tokens", ">= 256 tokens"]


def test_a_sessions_class_follows_the_geometric_mean_of_its_gaps() -> None:
    # Gaps of 100 s and then 2 s: the last gap alone says "< 8 s", their geometric mean (14.1 s) "< 64 s".
    # A request 0.1 s after the one before is the same burst: it keeps the bucket and adds no gap.
    policy = BayesPolicy(capacity=100)
    times = (0.0, 100.0, 102.0, 102.1, 102.1 + 7.0 ** 3 / 200.0)
    seen = []
    for i, now in enumerate(times):
        cls = policy._session_class(ctx(i, 1, now, session="s"), remember=True)
        seen.append(describe_class(cls)["session_gap"])
    # the fifth gap, 1.715 s: the geometric mean of 100, 2 and 1.715 s is 7 s
    assert seen == ["first request", ">= 64 s", "< 64 s", "< 64 s", "< 8 s"]
    assert policy._sessions["s"][3] == 3 and session_bucket(7.0) == 1


def test_past_max_sessions_the_half_idle_longest_is_forgotten() -> None:
    policy = BayesPolicy(capacity=100, max_sessions=4)
    for i, (session, now) in enumerate((("a", 0.0), ("b", 1.0), ("c", 2.0), ("d", 3.0), ("a", 100.0), ("e", 101.0))):
        policy._session_class(ctx(i, 1, now, session=session), remember=True)
    # five sessions at "e": the three seen last ("d" at 3 s, "a" at 100 s, "e") stay
    assert sorted(policy._sessions) == ["a", "d", "e"] and policy.sessions_known == 3
    gap = policy._session_class(ctx(6, 1, 102.0, session="b"), remember=False)
    assert describe_class(gap)["session_gap"] == "first request"
    assert describe_class(policy._session_class(ctx(6, 1, 200.0, session="a"), remember=False))["session_gap"] \
        == ">= 64 s"
    with pytest.raises(ValueError):
        BayesPolicy(capacity=100, max_sessions=0)


def _state(policy: BayesPolicy) -> tuple:
    """Everything an answer moves: each group's class, the class queues and the model's counts."""
    model = policy.model
    return (list(policy._gcls), [list(q) for q in policy._queues], sorted(policy._active),
            [list(r) for r in model.reached], [list(r) for r in model.reused], list(model.groups))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.sampled_from(["", "tool_use", "end_turn", "stop"]),
                          st.integers(0, 600), st.floats(0.0, 90.0)), min_size=1, max_size=40))
def test_an_answer_told_after_the_store_classes_as_one_known_at_it(requests) -> None:
    """With room for everything (nothing evicted, so nothing decided before the answer came), a request stored
    without its answer and told it right after leaves the policy exactly as one stored with it: the same class
    per group, queues in the same order and the same counts, refreshes and crossings included."""
    told, known = BayesPolicy(10_000, refresh_requests=3), BayesPolicy(10_000, refresh_requests=3)
    now, next_block = 0.0, 0
    history: dict[int, list[int]] = {}
    for session, fresh, finish, tokens, gap in requests:
        now += gap
        blocks = history.get(session, []) + list(range(next_block, next_block + fresh))
        next_block += fresh
        history[session] = blocks
        transition = int(TransitionType.APPEND if len(blocks) > fresh else TransitionType.FIRST)
        name = f"s{session}"
        known.access(blocks, RequestContext(index=0, now=now, transition=transition, session=name, finish=finish,
                                            output_tokens=tokens))
        told.access(blocks, RequestContext(index=0, now=now, transition=transition, session=name))
        told.answered(name, finish, tokens)
        told.check_integrity()
        assert _state(told) == _state(known)


def test_an_answer_moves_a_group_only_while_its_blocks_are_its_own() -> None:
    """Told after a block of the request was used again, the answer changes nothing (its counts are spread over
    other groups by then); an answer to a session with no request waiting, or told twice, is ignored."""
    policy = BayesPolicy(100)
    unknown = class_of(int(TransitionType.FIRST))
    policy.access([1, 2, 3], RequestContext(index=0, now=0.0, session="a"))
    policy.access([1, 9], RequestContext(index=1, now=5.0, session="b"))  # block 1 used again by another session
    policy.answered("a", "end_turn", 10)
    policy.answered("nobody", "end_turn", 10)
    assert policy._gcls[0] == unknown
    policy.answered("b", "end_turn", 10)
    assert policy._gcls[1] == class_of(int(TransitionType.FIRST), finish=2, answer=1)
    policy.answered("b", "tool_use", 900)  # no request of b waits for its answer any more
    assert policy._gcls[1] == class_of(int(TransitionType.FIRST), finish=2, answer=1)
    policy.check_integrity()


def test_a_first_request_waiting_for_its_answer_is_no_bypass_victim_of_its_own_store() -> None:
    """Stored before its answer is known, a session's first request would rank in the class of an unknown
    answer and go at once as that class's newest group; it goes last instead, and the answer places it."""
    policy = BayesPolicy(4)
    policy.access([1, 2], RequestContext(index=0, now=0.0, session="a", finish="end_turn", output_tokens=500))
    policy.access([3, 4], RequestContext(index=1, now=1.0, session="b", finish="end_turn", output_tokens=500))
    evicted = policy.access([5, 6], RequestContext(index=2, now=2.0, session="c"))
    assert sorted(evicted) == [1, 2] and 5 in policy and 6 in policy
    policy.answered("c", "end_turn", 10)
    policy.check_integrity()


def test_answers_told_out_of_order_keep_a_class_in_the_order_its_requests_came() -> None:
    policy = BayesPolicy(100)
    policy.access([1, 2], RequestContext(index=0, now=0.0, session="a"))
    policy.access([3, 4], RequestContext(index=1, now=1.0, session="b"))
    policy.answered("b", "end_turn", 10)
    policy.answered("a", "end_turn", 10)
    assert list(policy._queues[class_of(int(TransitionType.FIRST), finish=2, answer=1)]) == [0, 1]
    policy.check_integrity()


def test_until_its_answer_is_told_a_request_is_classed_as_its_sessions_last_answer_ended() -> None:
    policy = BayesPolicy(100)
    policy.access([1], RequestContext(index=0, now=0.0, session="s"))
    policy.answered("s", "tool_use", 40)
    policy.access([1, 2], RequestContext(index=1, now=5.0, session="s", transition=int(TransitionType.AGENT_STEP)))
    assert describe_class(policy._gcls[1])["finish"] == "tool call"
    policy.answered("s", "end_turn", 40)
    assert describe_class(policy._gcls[1])["finish"] == "end of turn"
    policy.access([1, 2, 3], RequestContext(index=2, now=90.0, session="s", transition=int(TransitionType.APPEND)))
    assert describe_class(policy._gcls[2])["finish"] == "end of turn"
    policy.check_integrity()


def test_requests_whose_answer_never_comes_are_given_up_past_max_sessions() -> None:
    policy = BayesPolicy(1000, max_sessions=4)
    for i in range(10):
        policy.access([10 * i, 10 * i + 1], RequestContext(index=i, now=float(i), session=f"s{i}"))
        assert len(policy._unanswered) <= 4
    policy.answered("s9", "end_turn", 10)  # the latest is still waiting
    assert describe_class(policy._gcls[9])["finish"] == "end of turn"
    policy.answered("s0", "end_turn", 10)  # given up long ago: nothing to move
    assert describe_class(policy._gcls[0])["finish"] == "unknown"
    policy.check_integrity()


def test_a_request_stored_in_parts_is_one_request_of_its_session_and_its_answer_moves_every_part() -> None:
    """vLLM's connector stores a long prompt chunk by chunk and the blocks an answer completes later: the parts
    after the first (`continues`) take its class, count no gap of the session's pace, and the answer moves
    them all."""
    policy = BayesPolicy(100)
    policy.access([1, 2], RequestContext(index=0, now=0.0, session="s", transition=int(TransitionType.APPEND)))
    pace = policy._sessions["s"]
    policy.access([3, 4], RequestContext(index=1, now=3.0, session="s", continues=True))  # FIRST by default: ignored
    policy.access([5], RequestContext(index=2, now=9.0, session="s", continues=True))
    assert policy._sessions["s"] == pace and policy._gcls == [policy._gcls[0]] * 3
    policy.answered("s", "end_turn", 300)
    assert [describe_class(c)["finish"] for c in policy._gcls] == ["end of turn"] * 3
    assert describe_class(policy._gcls[0])["transition"] == "append"
    policy.access([6], RequestContext(index=3, now=20.0, session="s", continues=True))  # nothing waits: no pace
    assert policy._sessions["s"][0] == 0.0
    policy.check_integrity()
