"""The live gap-to-Belady estimator: Belady never loses, and the gap opens where LRU thrashes."""

from kvcluster.belady_gap import BeladyGapEstimator
from kvcluster.keys import KeySpace

SPACE = KeySpace(model="gap")


def chain(ids):
    return SPACE.chain_hash_ids(ids)


def test_no_estimate_before_two_requests():
    est = BeladyGapEstimator(4)
    assert est.estimate() is None
    est.record(chain([1, 2]))
    assert est.estimate() is None


def test_a_cyclic_scan_larger_than_the_tier_is_where_lru_loses_to_belady():
    est = BeladyGapEstimator(capacity_blocks=4)
    for _ in range(20):
        for session in range(3):  # three 2-block sessions cycling through a 4-block tier: LRU always misses
            est.record(chain([session * 10, session * 10 + 1]))
    got = est.estimate()
    assert got.requests == 60 and got.policy_hit_rate == 0.0
    # after the 6 cold misses Belady (4 of the 6 blocks kept, the one needed furthest ahead dropped) hits 2 in 3
    assert got.belady_hit_rate == 76 / 120 and got.gap == got.belady_hit_rate


def test_a_working_set_that_fits_leaves_no_gap():
    est = BeladyGapEstimator(capacity_blocks=16)
    for _ in range(10):
        est.record(chain([1, 2, 3]))
    got = est.estimate()
    assert got.gap == 0.0 and got.policy_hit_rate == 27 / 30  # only the first request's 3 blocks miss
