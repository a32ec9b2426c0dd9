"""A node's controller: room made and destinations named before the writer copies, bookkeeping equal to the
tiers' bytes after every completed ticket, in-flight blocks pinned, stale and expired tickets cleaned up."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.cache_manager import CacheManager
from kvcluster.node_control import NodeController
from kvcluster.plan_executor import execute
from kvcluster.hierarchy import TierPlan
from test_cache_manager import DictTiers, key_of, payload_of


class TierMover:
    """The mover over an in-memory data plane: moves between tiers as the tier actors make them."""

    def __init__(self, tiers: DictTiers) -> None:
        self.tiers = tiers
        self.runs = 0

    def run(self, plan):
        self.runs += 1
        return execute(plan, self.tiers, {})

    def delete(self, keys) -> None:
        self.tiers.delete(keys)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(capacities=(2, 4), policy="lru", lease_s=60.0):
    tiers = DictTiers(list(capacities))
    manager = CacheManager([TierPlan(f"t{i}", c) for i, c in enumerate(capacities)], policy)
    clock = Clock()
    return NodeController(manager, TierMover(tiers), lease_s, clock), tiers, clock


def write(tiers: DictTiers, ticket, refuse=()) -> list[bytes]:
    """The writer's copy: the ticket's victims out of each tier it writes, then every block of the ticket into its
    tier, except those refused; returns the failed."""
    tiers.delete(ticket.evict)
    failed = []
    for t, keys in ticket.writes.items():
        ok = tiers.write({t: ([k for k in keys if k not in refuse], [payload_of(k) for k in keys if k not in refuse],
                              [None] * len(keys))})[t]
        failed += [k for k in keys if k in refuse] + [k for k, good in zip([k for k in keys if k not in refuse], ok)
                                                     if not good]
    return failed


def assert_match(control: NodeController, tiers: DictTiers) -> None:
    for t, resident in enumerate(control.manager.resident().values()):
        assert set(resident) == set(tiers.tiers[t]), t
        for k in resident:
            assert np.array_equal(tiers.tiers[t][k], payload_of(k))


def test_a_ticket_names_the_first_tier_after_the_victims_moved_down() -> None:
    control, tiers, _ = make()
    ks = [key_of(i) for i in range(1, 5)]
    first = control.prepare_store(ks[:2], ks[:2])
    assert first.writes == {0: ks[:2]} and tiers.tiers[0] == {}  # nothing written by the controller itself
    assert control.complete_store(first.plan_id, write(tiers, first))
    second = control.prepare_store(ks[2:], ks[2:])
    assert set(tiers.tiers[1]) == set(ks[:2]) and tiers.tiers[0] == {}  # room made before the writer's copy
    assert second.writes == {0: ks[2:]}
    control.complete_store(second.plan_id, write(tiers, second))
    assert_match(control, tiers)
    assert control.counters["written"] == 4 and control.counters["moves"] == 2


def test_an_in_flight_block_is_never_a_victim_of_another_ticket() -> None:
    control, tiers, _ = make(capacities=(2, 4))
    a, b, c = key_of(1), key_of(2), key_of(3)
    first = control.prepare_store([a], [a])  # a's bytes are on the way
    second = control.prepare_store([b, c], [b, c])  # tier 0 holds 2: a would be the LRU victim
    assert control.manager.tier_of(a) == 0 and a not in second.writes.get(0, [])
    control.complete_store(first.plan_id, write(tiers, first))
    control.complete_store(second.plan_id, write(tiers, second))
    assert_match(control, tiers)
    assert tiers.refused == 0


def test_a_refused_write_leaves_the_bookkeeping() -> None:
    control, tiers, _ = make()
    ks = [key_of(1), key_of(2)]
    ticket = control.prepare_store(ks, ks)
    failed = write(tiers, ticket, refuse={ks[1]})
    control.complete_store(ticket.plan_id, failed)
    assert control.manager.tier_of(ks[1]) is None and control.counters["refused"] == 1
    assert_match(control, tiers)


def test_an_expired_ticket_is_dropped_and_its_late_bytes_deleted() -> None:
    control, tiers, clock = make(lease_s=10)
    ks = [key_of(1), key_of(2)]
    ticket = control.prepare_store(ks, ks)
    clock.now = 11
    assert control.expire() == 1 and control.in_flight() == 0
    assert [control.manager.tier_of(k) for k in ks] == [None, None]
    failed = write(tiers, ticket)  # the writer was only slow: its bytes land after all
    assert not control.complete_store(ticket.plan_id, failed, ticket.writes)
    assert_match(control, tiers)  # deleted again: no tier holds bytes its manager does not count


def test_a_ticket_from_before_a_restart_keeps_only_what_the_new_view_adopted() -> None:
    control, tiers, _ = make()
    a, b = key_of(1), key_of(2)
    ticket = control.prepare_store([a, b], [a, b])
    tiers.write({0: ([a], [payload_of(a)], [None])})  # a landed before the restart, b after it
    fresh, _, _ = make()
    fresh.mover = TierMover(tiers)
    assert fresh.manager.adopt(0, list(tiers.tiers[0])) == []
    tiers.write({0: ([b], [payload_of(b)], [None])})
    assert not fresh.complete_store(ticket.plan_id, [], ticket.writes)  # another incarnation's ticket
    assert fresh.manager.tier_of(a) == 0 and b not in tiers.tiers[0]
    assert_match(fresh, tiers)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 12), min_size=1, max_size=5), st.booleans(), st.booleans()),
                min_size=1, max_size=40),
       st.sampled_from(["lru", "bayes", "s3fifo"]))
def test_bookkeeping_equals_the_tiers_after_every_settled_ticket(requests, policy) -> None:
    """Random requests, some writes refused, some tickets completed one request late (another ticket runs
    meanwhile): once every ticket is settled, the manager counts exactly the bytes the tiers hold."""
    control, tiers, _ = make(capacities=(3, 5), policy=policy)
    late = None
    for blocks, refuse_one, delay in requests:
        keys = [key_of(b) for b in dict.fromkeys(blocks)]
        held = {k for k in keys if control.manager.tier_of(k) is not None}
        ticket = control.prepare_store(keys, [k for k in keys if k not in held])
        failed = write(tiers, ticket, refuse={keys[-1]} if refuse_one else ())
        if late is not None:
            control.complete_store(*late)
            late = None
        if delay:
            late = (ticket.plan_id, failed)
        else:
            control.complete_store(ticket.plan_id, failed)
        control.manager.hierarchy.check_integrity() if hasattr(control.manager.hierarchy, "check_integrity") else None
    if late is not None:
        control.complete_store(*late)
    assert control.in_flight() == 0
    assert_match(control, tiers)


def test_a_drop_from_the_tier_the_writer_fills_is_handed_to_the_writer() -> None:
    """One tier: the victims of a store only make room for the writer's own blocks, so the writer deletes them in
    the call that writes (no call of the controller's own); the bookkeeping still equals the tier after it."""
    control, tiers, _ = make(capacities=(2,))
    ks = [key_of(i) for i in range(1, 5)]
    first = control.prepare_store(ks[:2], ks[:2])
    control.complete_store(first.plan_id, write(tiers, first))
    second = control.prepare_store(ks[2:], ks[2:])
    assert second.evict == {0: ks[:2]} and set(tiers.tiers[0]) == set(ks[:2])  # the controller deleted nothing
    assert control.mover.runs == 0
    control.complete_store(second.plan_id, write(tiers, second))
    assert_match(control, tiers)
    assert tiers.refused == 0
