"""The router's decision: session affinity, least-loaded placement of new sessions, sessionless continuations."""

from __future__ import annotations

import pytest

from kvcluster.session_routing import SessionRouter


def test_a_session_stays_on_its_node():
    router = SessionRouter(3)
    assert [router.route(s, [1, 2], 0.0) for s in ("a", "b", "c", "a", "b", "c")] == [0, 1, 2, 0, 1, 2]
    assert router.sessions_known == 3


def test_a_new_session_goes_to_the_node_with_the_fewest_recent_blocks():
    router = SessionRouter(3, window_s=10.0)
    assert router.route("a", list(range(10)), 0.0) == 0
    assert router.route("b", list(range(4)), 1.0) == 1
    assert router.route("c", list(range(6)), 2.0) == 2
    assert router.route("d", [0], 3.0) == 1  # 10, 4, 6 blocks recently
    assert router.load(1) == (5, 2, 1)
    assert router.route("a", list(range(20)), 4.0) == 0  # affinity beats load


def test_load_forgets_blocks_older_than_the_window():
    router = SessionRouter(2, window_s=10.0)
    assert router.route("a", list(range(100)), 0.0) == 0
    assert router.route("b", [1], 5.0) == 1
    assert router.load(0) == (100, 1, 0)
    assert router.route("c", [1], 10.0) == 0  # a's 100 blocks left the window: 0 against 1
    assert router.load(0) == (1, 2, 0)


def test_ties_go_to_fewer_sessions_then_the_lower_node():
    router = SessionRouter(3, window_s=1.0)
    assert router.route("a", [1], 0.0) == 0
    assert router.route("b", [1], 5.0) == 1  # every window empty: node 0 placed one session already
    assert router.route("c", [1], 10.0) == 2
    assert router.route("d", [1], 15.0) == 0


def test_a_shared_system_prompt_does_not_pull_sessions_together():
    router = SessionRouter(4)
    system = [7, 8, 9]
    nodes = [router.route(f"s{i}", system + [100 + i], float(i)) for i in range(8)]
    assert nodes == [0, 1, 2, 3, 0, 1, 2, 3]


def test_sessionless_requests_follow_the_request_they_continue():
    router = SessionRouter(3)
    assert router.route("", [1, 2], 0.0) == 0
    assert router.route("", [5, 6], 0.0) == 1
    assert router.route("", [1, 2, 3, 4], 1.0) == 0  # continues [1, 2]
    assert router.route("", [5, 6, 8], 1.0) == 1
    assert router.route("", [1, 2, 3, 4, 9], 2.0) == 0  # the deepest tail it holds: [1, 2, 3, 4]


def test_a_sessionless_prompt_many_requests_start_from_ties_only_its_first_continuation():
    router = SessionRouter(3)
    assert router.route("", [7, 8], 0.0) == 0  # a request of the shared prompt alone
    assert router.route("", [7, 8, 20], 1.0) == 0  # continues it, and takes its tail
    assert router.route("", [7, 8, 30], 2.0) == 1  # a branch: placed by load (node 0 holds 5 blocks)
    assert router.route("", [7, 8, 40], 3.0) == 2


def test_forgets_the_least_recent_half_past_max_sessions():
    router = SessionRouter(2, max_sessions=4)
    for i, s in enumerate("abcd"):
        router.route(s, [i], 0.0)
    router.route("a", [9], 0.0)  # a is now the most recent
    router.route("e", [9], 0.0)  # 5 > 4: b and c are forgotten
    assert router.sessions_known == 3
    assert router.route("a", [9], 0.0) == 0


@pytest.mark.parametrize("kwargs, field", [({"nodes": 0}, "nodes"), ({"nodes": 2, "window_s": 0}, "window_s"),
                                           ({"nodes": 2, "max_sessions": 0}, "max_sessions")])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SessionRouter(**kwargs)


def test_a_node_that_joins_takes_new_sessions_and_one_that_leaves_gives_its_sessions_up():
    router = SessionRouter(2)
    assert [router.route(s, [1], 0.0) for s in "ab"] == [0, 1]
    assert router.join() == 2 and router.nodes == 3
    assert router.route("c", [1], 0.0) == 2  # the new node is the least loaded
    router.leave(0)
    assert router.live == [1, 2]
    assert router.route("a", [1], 1.0) == 1  # placed again, on the least loaded live node
    assert router.route("a", [1], 2.0) == 1  # and stays there
    assert router.route("b", [1], 2.0) == 1 and router.route("c", [1], 2.0) == 2
    router.leave(1)
    router.leave(2)
    with pytest.raises(RuntimeError, match="nowhere"):
        router.route("d", [1], 3.0)
    with pytest.raises(ValueError, match="node"):
        router.leave(3)


def test_a_sessionless_continuation_of_a_node_that_left_is_placed_again():
    router = SessionRouter(2)
    assert router.route("", [1, 2], 0.0) == 0
    assert router.route("", [5], 0.0) == 1
    router.leave(0)
    assert router.route("", [1, 2, 3], 1.0) == 1


def test_a_joining_node_reuses_a_departed_ones_index_without_its_sessions():
    router = SessionRouter(2)
    assert [router.route(s, [1, 2], 0.0) for s in "ab"] == [0, 1]
    assert router.route("", [7, 8], 0.0) == 0  # a sessionless tail on node 0 too
    router.leave(0)
    assert router.join() == 0 and router.nodes == 2 and router.live == [0, 1]
    assert router.load(0) == (0, 0, 0)  # the newcomer starts unloaded
    assert router.sessions_known == 1  # "a" was node 0's: forgotten, not handed to the newcomer
    assert router.route("c", [1], 1.0) == 0  # the least loaded
    assert router.load(0) == (1, 1, 0)
    assert router.route("", [7, 8, 9], 1.0) == 0 and router.load(0) == (4, 2, 0)  # its tail forgotten: placed anew


def test_replicas_replaced_all_day_keep_as_many_slots_as_ran_at_once():
    router = SessionRouter(3)
    for step in range(1000):
        gone = step % 3
        router.leave(gone)
        assert router.join() == gone
        router.route(f"s{step}", [step], float(step))
    assert router.nodes == 3 and router.live == [0, 1, 2]
