"""A node's part of the cluster, started by the first engine that lands on it: found from Ray, not from a YAML.

`kvcluster cluster up` starts every node's actors from a cluster YAML that names each node by a Ray resource;
a Serve app whose replicas an autoscaler places has no such list. So each engine joining with `node: auto` names
its node from Ray (`ray_node_name`) and makes sure that node's parts run: its tier actors (its share of the
cluster's memory, its nvme) and its controller, pinned to it, and the cluster-wide index and predictor. Every
actor is detached and started with `get_if_exists`, so two replicas landing on one node at once start one set,
and a replica that restarts finds its node's blocks where it left them. What one node holds dies with the node:
its blocks become misses, and the shared filesystem (`ClusterLink.shared`) keeps the history.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvcluster.tiers import TierSpec

from .cluster import GAP_SYNC_EVERY
from .deploy import start_global_actors, start_tier_actor
from .index_actor import NAMESPACE
from .node_control_actor import NodeControlActor, control_name
from .tier_actor import TierActorConfig, actor_name

START_TIMEOUT_S = 120.0


def ray_node_name(node_id: str | None = None) -> str:
    """The cluster node name of a Ray node (default: this process's): stable while the node lives, unique in the
    cluster, short enough for actor names and metric tags."""
    return f"node-{(node_id or ray.get_runtime_context().get_node_id())[:12]}"


def ensure_node_parts(tiers: list[TierSpec], slot_bytes: int, policy: str, checkpoint_dir: str,
                      node_id: str | None = None) -> str:
    """Start (or find) the index, the predictor, and this Ray node's tier actors and controller; returns the
    node's name. Blocks until each has opened its storage, so the caller's first store finds them. A tier that
    holds no block is a ValueError naming it, before anything starts."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    node = ray_node_name(node_id)
    configs = [TierActorConfig(node=node, tier=tier, slot_bytes=slot_bytes) for tier in tiers]  # before any start
    start_global_actors(checkpoint_dir)
    handles = [start_tier_actor(config, node_id, detached=True) for config in configs]
    chain = [(f"{node}/{c.kind}", actor_name(node, c.kind), c.slots) for c in configs]
    ray.get([h.describe.remote() for h in handles], timeout=START_TIMEOUT_S)
    control = NodeControlActor.options(
        name=control_name(node), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(node, chain, policy, None, slot_bytes, GAP_SYNC_EVERY)
    ray.get(control.stats.remote(), timeout=START_TIMEOUT_S)
    return node
