"""Pooling the reuse-gap counts of several policies through one total (the predictor's role), exactly."""

from __future__ import annotations

import pytest

from kvcluster.gap_sync import GapCounts, GapSync, sync_all
from kvcluster.policies.base import RequestContext
from kvcluster.policies.bayes import BayesPolicy


def learnt(requests: list[list[int]], start: float = 0.0) -> BayesPolicy:
    policy = BayesPolicy(capacity=6)
    for i, blocks in enumerate(requests):
        policy.access(blocks, RequestContext(index=i, now=start + 3.0 * i, session="s"))
    policy.check_integrity()
    return policy


class Totals:
    """What the predictor actor does with a delta: add it, return the totals (a copy, as over the wire)."""

    def __init__(self) -> None:
        self.totals: GapCounts | None = None
        self.merges = 0

    def __call__(self, delta: GapCounts) -> GapCounts:
        if self.totals is None:
            self.totals = GapCounts.zeros(*delta.shape)
        self.totals.add(delta)
        self.merges += 1
        return GapCounts.from_dict(self.totals.to_dict())


def counts(policy: BayesPolicy) -> GapCounts:
    return GapCounts([list(r) for r in policy.model.reached], [list(r) for r in policy.model.reused],
                     list(policy.model.groups))


def test_two_policies_end_with_the_sum_of_what_each_learnt_and_nothing_counts_twice() -> None:
    a = learnt([[1, 2], [1, 2, 3], [1, 2, 3, 4]])
    b = learnt([[7], [8], [7, 8]], start=100.0)
    alone_a, alone_b = counts(a), counts(b)
    expected = GapCounts.zeros(*alone_a.shape)
    expected.add(alone_a)
    expected.add(alone_b)
    assert alone_a.total_reached() == 9 and alone_b.total_reached() == 4  # block uses: 2+3+4 and 1+1+2
    assert sum(alone_a.groups) == sum(alone_b.groups) == 3  # one group per request
    merge = Totals()
    syncs = [GapSync(a.model), GapSync(b.model)]
    sync_all(syncs, merge)
    assert counts(a) == counts(b) == expected
    sync_all(syncs, merge)  # nothing new: a zero delta, the totals stay
    assert merge.totals == expected and counts(a) == expected
    a.access([1, 2], RequestContext(index=9, now=20.0, session="s"))  # one more request on one node
    sync_all(syncs, merge)
    assert merge.totals.total_reached() == 9 + 4 + 2 and counts(b) == merge.totals
    assert sum(merge.totals.groups) == 7 and b.model.groups == merge.totals.groups
    a.check_integrity()


def test_a_fresh_policy_starts_from_the_totals() -> None:
    merge = Totals()
    sync_all([GapSync(learnt([[1, 2], [1, 2]]).model)], merge)
    fresh = BayesPolicy(capacity=6)
    sync_all([GapSync(fresh.model)], merge)
    assert counts(fresh) == merge.totals and counts(fresh).total_reached() == 4


def test_counts_of_another_shape_are_refused_and_round_trip_as_json() -> None:
    policy = learnt([[1], [1]])
    with pytest.raises(ValueError, match="shape"):
        GapSync(policy.model).install(GapCounts.zeros(2, 3))
    c = counts(policy)
    assert GapCounts.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="cannot join"):
        c.add(GapCounts.zeros(1, 1))


def test_totals_saved_before_groups_were_counted_load_with_none() -> None:
    c = counts(learnt([[1, 2], [1, 2]]))
    old = {"reached": c.reached, "reused": c.reused}  # a checkpoint without group counts
    loaded = GapCounts.from_dict(old)
    assert loaded.groups == [0.0] * len(c.reached) and loaded.reached == c.reached
    with pytest.raises(ValueError, match="group counts"):
        GapCounts(c.reached, c.reused, [1.0])
