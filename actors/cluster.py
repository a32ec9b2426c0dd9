"""`kvcluster cluster up|status|down`: the cache actors on a running Ray cluster, from a cluster YAML."""

from __future__ import annotations

import socket

import ray

from kvcluster.cluster_config import ClusterConfig, NodeEntry
from kvcluster.cluster_control import node_chains
from kvcluster.errors import ConfigError, KvclusterError
from kvcluster.tiers import TIER_ORDER

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .deploy import start_global_actors, start_tier_actor
from .index_actor import NAMESPACE, shard_name
from .index_client import IndexClient
from .node_control_actor import NodeControlActor, control_name
from .predictor_actor import PREDICTOR_NAME
from .tier_actor import TierActorConfig, actor_name


GAP_SYNC_EVERY = 32  # commits between poolings of the policies' reuse-gap counts (one predictor call)


class ClusterUnreachable(KvclusterError):
    """No Ray cluster answers at the given address."""


def connect(address: str) -> None:
    if ray.is_initialized():
        return
    host, _, port = address.rpartition(":")
    if host and port.isdigit():  # an explicit GCS address: fail in seconds, not after Ray's long retry loop
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as exc:
            raise ClusterUnreachable(f"no Ray cluster at --address {address!r}: {exc.strerror or exc}") from None
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ClusterUnreachable(f"no Ray cluster at --address {address!r}: {first}") from None


def _ray_node_id(node: NodeEntry, alive: list[dict]) -> str:
    key = node.ray_resource or "node:__internal_head__"
    for n in alive:
        if n["Resources"].get(key, 0) > 0:
            return n["NodeID"]
    raise ConfigError(f"node {node.name!r}: no live Ray node has the resource {key!r}")


def node_ids(cfg: ClusterConfig) -> dict[str, str]:
    """Cluster node name -> Ray node id (hex), for the nodes of `cfg` that are alive now."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    out = {}
    for node in cfg.nodes:
        try:
            out[node.name] = _ray_node_id(node, alive)
        except ConfigError:
            continue
    return out


def up(cfg: ClusterConfig) -> dict:
    """Start (or find) the index, predictor, every tier actor and each node's controller; idempotent.

    Each node's controller (on that node) places its blocks with `cfg.policy` over its own tiers, so a tier
    only ever receives writes it has room for."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    pinned = {node.name: _ray_node_id(node, alive) for node in cfg.nodes}  # fail before starting anything
    start_global_actors(cfg.checkpoint_dir, predictor_config=cfg.predictor.model_dump(), index_shards=cfg.index_shards)
    slot_bytes = cfg.block_bytes()
    started, handles = [], []
    for node in cfg.nodes:
        for t in sorted(node.tiers, key=lambda t: TIER_ORDER.index(t.kind)):
            cfg.slots(t)  # a ConfigError naming the tier when it holds no block
            tc = TierActorConfig(node=node.name, tier=t, slot_bytes=slot_bytes)
            handles.append(start_tier_actor(tc, pinned[node.name], detached=True))
            started.append(actor_name(node.name, t.kind))
    ray.get([h.describe.remote() for h in handles], timeout=120)  # constructed: their slabs and directories open
    controls = start_node_controllers(cfg, slot_bytes, pinned)
    ray.get([c.stats.remote() for c in controls.values()], timeout=120)  # their views rebuilt from the tiers
    return {"tiers": started, "controllers": [control_name(n) for n in controls], "block_bytes": slot_bytes,
            "policy": cfg.policy, "index_shards": cfg.index_shards}


def start_node_controllers(cfg: ClusterConfig, slot_bytes: int, pinned: dict[str, str]) -> dict:
    """One controller per node (detached, found again by name), on that node, over that node's tiers."""
    handles = {}
    for name, chain in node_chains(cfg).items():
        tiers = [(t.label, actor_name(name, t.tier.kind), t.capacity_blocks) for t in chain]
        handles[name] = NodeControlActor.options(
            name=control_name(name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=pinned[name], soft=False),
        ).remote(name, tiers, cfg.policy, None, slot_bytes, GAP_SYNC_EVERY)
    return handles


def status(cfg: ClusterConfig) -> dict:
    """Per node and tier: blocks held and capacity (from the tier actors), plus index totals."""
    rows, refs = [], []
    for node in cfg.nodes:
        for t in node.tiers:
            try:
                actor = ray.get_actor(actor_name(node.name, t.kind), namespace=NAMESPACE)
            except ValueError:
                rows.append({"node": node.name, "tier": t.kind, "state": "absent"})
                continue
            rows.append({"node": node.name, "tier": t.kind, "state": "running"})
            refs.append((rows[-1], actor.describe.remote()))
    for row, ref in refs:
        try:
            d = ray.get(ref, timeout=30)
            row.update(used_blocks=d["used_blocks"], capacity_blocks=d["capacity_blocks"])
        except ray.exceptions.RayError as exc:
            row["state"] = f"unavailable ({type(exc).__name__})"
    out: dict = {"tiers": rows}
    try:
        out["index"] = IndexClient.connect(timeout_s=30).occupancy(timeout_s=30)
    except ValueError:
        out["index"] = None
    out["control"] = {}
    for node in cfg.nodes:
        try:
            out["control"][node.name] = ray.get(ray.get_actor(control_name(node.name), namespace=NAMESPACE)
                                                .stats.remote(), timeout=30)
        except ValueError:
            out["control"][node.name] = None
        except ray.exceptions.RayError as exc:
            out["control"][node.name] = f"unavailable ({type(exc).__name__})"
    return out


def _running_count(first: str, configured: int) -> int:
    """How many shards the running actor `first` (shard 0) has: a config edited since `up` may say otherwise."""
    try:
        return ray.get(ray.get_actor(first, namespace=NAMESPACE).shard_count.remote(), timeout=30)
    except (ValueError, ray.exceptions.RayError):
        return configured


def down(cfg: ClusterConfig) -> list[str]:
    """Kill this config's tier actors and the global actors; files on nvme and pfs stay."""
    names = [actor_name(n.name, t.kind) for n in cfg.nodes for t in n.tiers]
    names += [control_name(n.name) for n in cfg.nodes]
    names += [PREDICTOR_NAME] + [shard_name(i) for i in range(_running_count(shard_name(0), cfg.index_shards))]
    killed = []
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
        if name == PREDICTOR_NAME:
            ray.get(actor.checkpoint.remote(), timeout=60)  # posteriors outlive the actor
        ray.kill(actor, no_restart=True)
        killed.append(name)
    return killed
