"""The pool's manager: the policy's decisions turned into writes and deletes, lost locations forgotten."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.policies.base import RequestContext
from kvcluster.policies.registry import make_policy
from kvcluster.pool import PoolManager


def ctx(i: int) -> RequestContext:
    return RequestContext(i, float(i))


def test_admitted_blocks_are_written_once_and_victims_deleted_where_they_are() -> None:
    pool = PoolManager("lru", 3)
    assert pool.access(["a", "b"], ctx(0), at="n0") == (["a", "b"], {})
    assert pool.access(["a", "c"], ctx(1), at="n1") == (["c"], {})  # a is stored already
    assert pool.lookup(["a", "b", "c", "d"]) == ["n0", "n0", "n1", None]
    write, delete = pool.access(["d"], ctx(2), at="n1")
    assert write == ["d"] and delete == {"n0": ["b"]}  # LRU's victim, deleted at the location it was written to
    pool.check_integrity()


def test_a_lost_location_and_forgotten_blocks_are_never_returned_again() -> None:
    pool = PoolManager("lru", 8)
    pool.access(["a", "b"], ctx(0), at="n0")
    pool.access(["c", "d"], ctx(1), at="n1")
    assert pool.lost("n1") == 2 and pool.lookup(["c", "d"]) == [None, None]
    assert pool.forget(["a", "zz"]) == 1 and pool.lookup(["a", "b"]) == [None, "n0"]
    assert pool.locations() == {"n0": 1}
    pool.check_integrity()
    assert pool.access(["c"], ctx(2), at="n0") == (["c"], {})  # a miss, written again where told


requests = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=8), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None)
@given(requests, st.integers(1, 12), st.sampled_from(["lru", "bayes", "arc", "s3fifo"]))
def test_the_pool_stores_exactly_what_its_policy_holds_under_key_sweeps(reqs, capacity, policy) -> None:
    """Writes minus deletes is the policy's resident set after every request, whatever ids the keys get after
    sweeps: the decisions are those of the policy fed the blocks themselves."""
    pool = PoolManager(policy, capacity, keys_swept_from=4)
    alone = make_policy(policy, capacity)
    held: set = set()
    for i, blocks in enumerate(reqs):
        keys = [f"k{b}" for b in blocks]
        write, delete = pool.access(keys, ctx(i), at="pfs")
        alone.access(blocks, ctx(i))
        gone = [k for ks in delete.values() for k in ks]
        assert set(gone) <= held and not (set(write) & held)
        held = (held - set(gone)) | set(write)
        assert held == {f"k{b}" for b in alone.resident()} == set(pool.resident())
        pool.check_integrity()


def test_a_pool_of_one_shard_decides_as_one_manager() -> None:
    from kvcluster.pool import ShardedPool

    one, sharded = PoolManager("lru", 5), ShardedPool("lru", 5, 1)
    for i, keys in enumerate([[1, 2, 3], [2, 4], [5, 6, 7, 1], [8]]):
        assert sharded.access(keys, ctx(i), at=f"n{i % 2}") == one.access(keys, ctx(i), at=f"n{i % 2}")
        assert sharded.lookup(list(range(10))) == one.lookup(list(range(10)))
    sharded.check_integrity()


@settings(max_examples=50, deadline=None)
@given(requests, st.integers(1, 6))
def test_a_sharded_pool_keeps_each_key_in_its_shard_within_its_share(reqs, shards) -> None:
    """Every key lives in its own shard, each shard within its share of the capacity, what a request writes
    comes in its order, and the pool stores exactly what its answers wrote and did not delete since."""
    from kvcluster.pool import ShardedPool, shard_of

    pool = ShardedPool("lru", 12, shards)
    assert pool.capacity == 12 and sorted(m.capacity for m in pool.shards)[-1] - sorted(
        m.capacity for m in pool.shards)[0] <= 1
    stored: set = set()
    for i, keys in enumerate(reqs):
        write, delete = pool.access(keys, ctx(i), at="n0")
        order = [keys.index(k) for k in write]
        assert order == sorted(order)
        for gone in delete.values():
            stored -= set(gone)
        stored |= set(write)
        assert set(pool.resident()) == stored and len(pool) <= 12
        pool.check_integrity()
    for s, m in enumerate(pool.shards):
        assert all(shard_of(k, shards) == s for k in m.resident()) and len(m) <= m.capacity


def test_a_restarted_manager_adopts_what_the_storage_holds_and_names_what_it_cannot_keep() -> None:
    pool = PoolManager("lru", 3)
    assert pool.adopt(["a", "b", "c", "d", "b"], "pfs") == ["a"]  # 4 blocks for 3 places: the oldest goes
    assert pool.lookup(["a", "b", "c", "d"]) == [None, "pfs", "pfs", "pfs"]
    pool.check_integrity()
    write, delete = pool.access(["e"], ctx(1), at="pfs")
    assert write == ["e"] and delete == {"pfs": ["c"]}  # adopted blocks are the policy's like any other


def test_adopting_nothing_leaves_the_policy_as_it_was() -> None:
    fresh, adopted = PoolManager("bayes", 4), PoolManager("bayes", 4)
    assert adopted.adopt([], "pfs") == []
    for i, keys in enumerate([[1, 2, 3], [1, 2, 4, 5], [6, 1], [7, 8, 9, 2]]):
        assert adopted.access(keys, ctx(i), at="pfs") == fresh.access(keys, ctx(i), at="pfs")
