"""A trace replayed over N nodes: node-local tiers split over the nodes, one pooled tier shared by all.

Each node runs its own hierarchy (`build_hierarchy`) over its 1/N share of every
node-local tier and sees only the requests routed to it (`SessionRouter`: session
affinity, new sessions on the least-loaded node). Without a pool the same total
capacity is all node-local, every tier split per node; with one node that is
exactly the simulator's replay of the same tiers.

The pool (peers' DRAM lent over RDMA, or the shared filesystem: one pool whichever
node reads it) is written through: every block a node uses is stored in it too,
as Mooncake's engines put each prefill's KV into its store, and its manager, which
holds metadata only, runs the policy over the uses of every node in arrival order
(`kvcluster.pool.PoolManager`: the object the live pool manager actor holds, so
`kvcluster.actors.live_cluster_replay` replays the same decisions on real bytes).
So the pool's policy sees exactly the stream one node's single tier would see,
whatever the number of nodes and wherever the sessions went, and the predictive
policy keeps its edge at any scale. A node's tiers are caches in front of it: a
pool hit is copied up (the pool keeps its copy: it holds what its policy keeps,
and another node may read it next), and a node's victims are dropped, not written
back (the pool holds them already, or its policy let them go). The price is the
copies: what a node holds the pool mostly holds too.

The alternative measured first, an exclusive pool fed each node's victims (the
simulator's two-tier hierarchy stretched over nodes), loses the edge: with small
node-local tiers nearly every block is a victim at once, so the pool ranks blocks
by when a node let them go, and `bayes` admitting them out of use order ranked
them worse than LRU (docs/scaling.md).

A hit is a block of the request's prefix run found in the serving node's local
tiers or in the pool; `local_share` is the part found locally. One node is the
same machinery with N = 1, so the ratio to N nodes compares like with like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from .hierarchy import Hierarchy, TierPlan, build_hierarchy
from .policies.registry import POLICIES
from .pool import PoolManager, ShardedPool
from .session_routing import SessionRouter
from .simulator import PreparedTrace, request_context


@dataclass(frozen=True)
class ClusterPlan:
    """Tiers of the whole cluster: `local` ones (fastest first) split evenly over the nodes, and `pool`, one tier
    shared by all nodes below them (None: none)."""

    local: tuple[TierPlan, ...]
    pool: TierPlan | None = None

    def flattened(self) -> "ClusterPlan":
        """The same capacity all node-local: the pool becomes every node's last local tier, split too."""
        return ClusterPlan(self.local + ((self.pool,) if self.pool else ()))


@dataclass(frozen=True)
class ClusterResult:
    trace: str
    nodes: int
    policy: str
    pooled: bool
    hit_rate: float
    local_share: float  # of the hit blocks, those found in the serving node's own tiers
    block_refs: int
    local_hits: int
    pool_hits: int
    requests_per_node_max: int  # the busiest node's requests (the mean is requests / nodes)
    seconds: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def split_capacity(capacity: int, nodes: int, tier: str = "tier") -> list[int]:
    """A tier's blocks split over `nodes`: equal shares, the remainder to the first nodes."""
    if capacity < nodes:
        raise ValueError(f"{tier}: {capacity} blocks cannot be split over {nodes} nodes (each needs one)")
    share, extra = divmod(capacity, nodes)
    return [share + (i < extra) for i in range(nodes)]


class Cluster:
    """N node hierarchies and an optional shared pool; `serve` is one request on one node."""

    def __init__(self, policy: str, plan: ClusterPlan, nodes: int, pool_policy: str | None = None,
                 pool_shards: int = 1) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: unknown {policy!r}; choose from {', '.join(POLICIES)}")
        if POLICIES[policy].offline:
            raise ValueError(f"policy: {policy!r} reads the future; the cluster replay runs online policies")
        if not plan.local:
            raise ValueError("plan.local: at least one node-local tier")
        shares = [split_capacity(t.capacity_blocks, nodes, f"plan.local {t.name!r}") for t in plan.local]
        self.nodes: list[Hierarchy] = [
            build_hierarchy(policy, [TierPlan(t.name, share[i]) for t, share in zip(plan.local, shares)])
            for i in range(nodes)]
        if plan.pool is None:
            self.pool = None
        elif pool_shards == 1:
            self.pool = PoolManager(pool_policy or policy, plan.pool.capacity_blocks)
        else:  # split by key hash over managers of their own (`ShardedPool`)
            self.pool = ShardedPool(pool_policy or policy, plan.pool.capacity_blocks, pool_shards)

    def serve(self, node: int, blocks: Sequence[int], ctx) -> tuple[int, int]:
        """Serve a request on `node`; returns (prefix blocks found in its local tiers, found in the pool)."""
        local, pool = self.nodes[node], self.pool
        local_hits = pool_hits = 0
        for block in blocks:
            if block in local:
                local_hits += 1
            elif pool is not None and block in pool:
                pool_hits += 1
            else:
                break
        if pool is not None:
            pool.access(blocks, ctx)  # written through (the live pool's manager is this same `PoolManager`)
        local.serve(blocks, ctx)  # its victims are dropped: the pool holds them, or let them go
        return local_hits, pool_hits

    def check_integrity(self) -> None:
        for hierarchy in self.nodes:
            hierarchy.check_integrity()
        if self.pool is not None:
            self.pool.check_integrity()


def replay_cluster(trace: PreparedTrace, policy: str, plan: ClusterPlan, nodes: int, *, pooled: bool = True,
                   pool_policy: str | None = None, pool_shards: int = 1, check_every: int = 0) -> ClusterResult:
    """Replay `trace` over `nodes` nodes; without `pooled` the plan's pool is split per node as a local tier.
    `pool_shards` > 1: the pool split by key hash over that many managers."""
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an int >= 1, got {nodes!r}")
    cluster = Cluster(policy, plan if pooled else plan.flattened(), nodes, pool_policy, pool_shards)
    router = SessionRouter(nodes)
    served = [0] * nodes
    local_total = pool_total = 0
    started = time.perf_counter()
    for i, blocks in enumerate(trace.blocks):
        node = router.route(trace.sessions[i], blocks, trace.arrivals[i])
        served[node] += 1
        local_hits, pool_hits = cluster.serve(node, blocks, request_context(trace, i))
        local_total += local_hits
        pool_total += pool_hits
        if check_every and i % check_every == 0:
            cluster.check_integrity()
    hits = local_total + pool_total
    return ClusterResult(trace=trace.name, nodes=nodes, policy=policy, pooled=pooled and plan.pool is not None,
                         hit_rate=hits / max(1, trace.block_refs), local_share=local_total / hits if hits else 0.0,
                         block_refs=trace.block_refs, local_hits=local_total, pool_hits=pool_total,
                         requests_per_node_max=max(served), seconds=time.perf_counter() - started)
