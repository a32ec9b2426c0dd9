"""The N-node replay: node-local tiers split per node, one written-through pool shared by all nodes."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.cluster_sim import Cluster, ClusterPlan, replay_cluster, split_capacity
from kvcluster.policies.registry import make_policy
from kvcluster.session_routing import SessionRouter
from kvcluster.hierarchy import TierPlan
from kvcluster.simulator import PreparedTrace, replay, request_context


def prepared(requests: list[tuple[str, list[int]]], types: int = 1) -> PreparedTrace:
    """Requests of (session, block ids) one second apart; `types` the block type of every block."""
    blocks = tuple(tuple(b) for _, b in requests)
    return PreparedTrace(name="synthetic", block_size=16, blocks=blocks,
                         types=tuple((types,) * len(b) for b in blocks), transitions=(1,) * len(blocks),
                         arrivals=tuple(float(i) for i in range(len(blocks))),
                         input_tokens=tuple(16 * len(b) for b in blocks), sessions=tuple(s for s, _ in requests),
                         unique_blocks=len({x for b in blocks for x in b}))


def plan(local: int, pool: int) -> ClusterPlan:
    return ClusterPlan((TierPlan("local", local),), TierPlan("pool", pool))


def test_a_pool_hit_on_another_node_and_a_local_hit_count_both():
    trace = prepared([("s0", [1, 2]), ("s1", [1, 3]), ("s0", [1, 2])])
    pooled = replay_cluster(trace, "lru", plan(2, 4), 2)
    assert (pooled.local_hits, pooled.pool_hits) == (1, 2)  # s1 reads 1 from the pool; s0 finds 1 there, 2 at home
    assert pooled.hit_rate == 0.5 and pooled.local_share == pytest.approx(1 / 3)
    assert pooled.requests_per_node_max == 2
    split = replay_cluster(trace, "lru", plan(2, 4), 2, pooled=False)
    assert (split.local_hits, split.pool_hits, split.local_share) == (2, 0, 1.0)  # s1 cannot see node 0's copy


requests = st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", ""]),
                              st.lists(st.integers(0, 30), min_size=1, max_size=8)), min_size=1, max_size=40)


@settings(max_examples=30, deadline=None)
@given(requests, st.integers(1, 4), st.integers(0, 8), st.integers(0, 12), st.sampled_from(["lru", "bayes"]),
       st.sampled_from([0, 1]))
def test_capacities_hold_and_the_pool_is_one_tier_over_the_whole_trace(reqs, nodes, local, pool, policy, kind):
    """Whatever the nodes and routing, the pool holds what one tier of its policy fed every request would hold,
    so the cluster hits at least what that one tier hits; no tier ever exceeds its capacity."""
    trace = prepared(reqs, types=kind)
    cluster_plan = plan(local + nodes, pool + 1)
    cluster = Cluster(policy, cluster_plan, nodes)
    alone = make_policy(policy, pool + 1)
    router = SessionRouter(nodes)
    for i, blocks in enumerate(trace.blocks):
        ctx = request_context(trace, i)
        cluster.serve(router.route(trace.sessions[i], blocks, trace.arrivals[i]), blocks, ctx)
        alone.access(blocks, ctx)
        cluster.check_integrity()
        assert all(len(p) <= p.capacity for h in cluster.nodes for p in h.policies)
        assert sum(p.capacity for h in cluster.nodes for p in h.policies) == local + nodes
        assert set(cluster.pool.resident()) == set(alone.resident())
    result = replay_cluster(trace, policy, cluster_plan, nodes, check_every=1)
    one_tier = replay(trace, policy, [cluster_plan.pool])
    assert result.local_hits + result.pool_hits >= one_tier.prefix_hits


@settings(max_examples=30, deadline=None)
@given(requests, st.integers(1, 6), st.integers(1, 10), st.sampled_from(["lru", "bayes", "arc"]))
def test_one_node_without_a_pool_is_the_simulators_replay(reqs, local, pool, policy):
    trace = prepared(reqs)
    result = replay_cluster(trace, policy, plan(local, pool), 1, pooled=False, check_every=1)
    reference = replay(trace, policy, [TierPlan("local", local), TierPlan("pool", pool)])
    assert result.local_hits == reference.prefix_hits and result.pool_hits == 0


@settings(max_examples=15, deadline=None)
@given(requests, st.integers(1, 5), st.booleans())
def test_a_replay_is_deterministic(reqs, nodes, pooled):
    trace = prepared(reqs)
    runs = [dataclasses.replace(replay_cluster(trace, "bayes", plan(8, 8), nodes, pooled=pooled), seconds=0.0)
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_capacity_is_split_evenly_with_the_remainder_first():
    assert split_capacity(10, 4) == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="pool"):
        split_capacity(3, 4, "pool")


@pytest.mark.parametrize("args, field", [(("belady", plan(4, 4), 2), "policy"), (("nope", plan(4, 4), 2), "policy"),
                                         (("lru", ClusterPlan(()), 2), "plan.local"),
                                         (("lru", plan(1, 4), 2), "plan.local 'local'")])
def test_bad_input_names_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        Cluster(*args)


def test_nodes_must_be_a_positive_int():
    with pytest.raises(ValueError, match="nodes"):
        replay_cluster(prepared([("a", [1])]), "lru", plan(4, 4), 0)


@settings(max_examples=20, deadline=None)
@given(requests, st.integers(1, 3), st.integers(2, 5), st.sampled_from(["lru", "bayes"]))
def test_a_pool_split_by_key_hash_keeps_its_capacity_and_one_shard_is_one_pool(reqs, nodes, shards, policy):
    """`pool_shards=1` is the one manager, hit for hit; split, every shard stays within its share (checked after
    every request)."""
    trace = prepared(reqs)

    def hits(result) -> tuple:
        return result.local_hits, result.pool_hits, result.requests_per_node_max

    one = replay_cluster(trace, policy, plan(nodes, 8), nodes)
    assert hits(replay_cluster(trace, policy, plan(nodes, 8), nodes, pool_shards=1)) == hits(one)
    split = replay_cluster(trace, policy, plan(nodes, 8), nodes, pool_shards=shards, check_every=1)
    assert split.block_refs == one.block_refs
    assert split.local_hits + split.pool_hits <= split.block_refs
