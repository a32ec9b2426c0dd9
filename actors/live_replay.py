"""`kvcluster replay TRACE --live`: a trace through real tier actors and the cluster's control plane.

The cluster YAML's first node gives the tiers (its hierarchy, as the control plane
runs it: fastest first, ending in its share of pfs); each becomes a real tier actor
with its real backend (memory pool, nvme slab, pfs files) under a scratch directory,
sized to the replay's capacities in blocks of `block_bytes` (small blocks keep the
bytes moved modest). The node's controller, the one a cluster runs, places every
request with the policy; the driver reads each request's cached run from the tier
actors the controller names and writes its new blocks, with stand-in KV bytes
derived from the block id, straight into the tiers (`NodeWriter`), as an engine does. A hit counts only when its
bytes come back from a tier and equal what was stored, so the live hit rates are
measured on bytes, not read off the bookkeeping; the simulator's figures for the same
tiers print beside them.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import ray

from kvcluster.cluster_config import ClusterConfig, load_cluster_config
from kvcluster.cluster_control import node_chains
from kvcluster.errors import ConfigError
from kvcluster.keys import stand_in_key
from kvcluster.hierarchy import TierPlan
from kvcluster.simulator import PreparedTrace, ReplayResult, replay, request_context

from .cluster import node_ids
from .deploy import start_tier_actor
from .index_actor import INDEX_NAME, NAMESPACE, IndexActor
from .node_control_actor import NodeControlActor, control_name
from .node_writer import NodeWriter
from .tier_actor import TierActorConfig, actor_name

DEFAULT_BLOCK_BYTES = 4096


def block_key(block: int) -> bytes:
    return stand_in_key(block)  # a digest of the tiers' key width, spread over shards as real keys are


def block_payload(key: bytes, nbytes: int) -> np.ndarray:
    """Stand-in KV bytes, different for every block, so a block served from the wrong place shows."""
    pattern = np.frombuffer(key, dtype=np.uint8)
    return np.resize(pattern, nbytes) ^ np.arange(nbytes, dtype=np.uint8)


def replay_live(trace: PreparedTrace, policy: str, cluster: str | ClusterConfig,
                capacities: list[int] | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES,
                progress: Callable[[int], None] | None = None, prefetch_lead_s: float = 0.0,
                answers_at_finish: bool = False) -> dict:
    """Replay `trace` through the live control plane; returns the live result and the simulated one.

    `prefetch_lead_s > 0`: after each request, the requests arriving within that many seconds of it count
    as queued, and the control plane lifts their held prefixes into the first tier (as the simulator's
    `--prefetch-lead-s` does). `answers_at_finish`: each request is served without how its answer ended, told
    to the controller right after (`answered`), as vLLM's connector tells it; simulated the same way."""
    cfg = cluster if isinstance(cluster, ClusterConfig) else load_cluster_config(cluster)
    node = cfg.nodes[0]
    chain = node_chains(cfg)[node.name]
    labels = [t.label for t in chain]
    if capacities is None:
        capacities = [t.capacity_blocks for t in chain]
    if len(capacities) != len(chain):
        raise ConfigError(f"capacity: give one value per tier of node {node.name} ({', '.join(labels)}), "
                          f"got {len(capacities)}")
    if any(c < 1 for c in capacities):
        raise ConfigError("capacity: every live tier needs room for at least one block")
    if block_bytes < 512 or block_bytes % 512:
        raise ConfigError(f"--live-block-bytes must be a positive multiple of 512, got {block_bytes}")
    own_ray = not ray.is_initialized()
    if own_ray:  # a Ray of its own: never the actors of a cluster that is serving
        ray.init(address="local", namespace=NAMESPACE, log_to_driver=False, include_dashboard=False)
    scratch = Path(tempfile.mkdtemp(prefix="kvcluster-live-"))
    started = []
    try:
        pinned = node_ids(cfg)
        if node.name not in pinned:
            raise ConfigError(f"nodes: no live Ray node for {node.name} (its ray_resource is absent)")
        started.append(IndexActor.options(name=INDEX_NAME, namespace=NAMESPACE).remote())
        for t, cap in zip(chain, capacities):
            path = str(scratch / t.tier.kind) if t.tier.kind_info.durable else None
            tc = TierActorConfig.of(node.name, t.tier.kind, cap, block_bytes, path)
            started.append(start_tier_actor(tc, pinned[node.name]))
        ray.get([a.describe.remote() for a in started[1:]], timeout=120)
        control = NodeControlActor.options(name=control_name(node.name), namespace=NAMESPACE).remote(
            node.name, [(t.label, actor_name(node.name, t.tier.kind), cap) for t, cap in zip(chain, capacities)],
            policy, None, block_bytes, 0)
        started.append(control)
        live = _drive(trace, control, NodeWriter(node.name), len(chain), block_bytes, progress, prefetch_lead_s,
                      answers_at_finish)
        stats = ray.get(control.stats.remote(), timeout=120)
    finally:
        for actor in started:
            ray.kill(actor, no_restart=True)
        if own_ray:
            ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    plan = [TierPlan(label, cap) for label, cap in zip(labels, capacities)]
    hits, wrong, seconds = live
    refs = trace.block_refs
    evictions = [c["evictions"] for c in stats["counters"]]
    result = ReplayResult(
        policy=policy, capacity_blocks=sum(capacities),
        tiers=[{"name": t.name, "capacity_blocks": t.capacity_blocks, "hits": h, "hit_rate": h / max(1, refs),
                "evictions": e} for t, h, e in zip(plan, hits, evictions)],
        hit_rate=sum(hits) / max(1, refs), block_refs=refs, prefix_hits=sum(hits), evictions=evictions[-1],
        seconds=seconds)
    if prefetch_lead_s > 0 and len(plan) > 1:
        result.prefetch = stats["prefetch"]
    simulated = replay(trace, policy, plan, prefetch_lead_s=prefetch_lead_s, answers_at_finish=answers_at_finish)
    return {"driver": "live", "cluster": cfg.model_dump(include={"model"}) | {"tiers": labels},
            "block_bytes": block_bytes, "wrong_bytes": wrong, "control_payload_bytes": stats["payload_bytes"],
            "live": result.to_dict(),
            "simulated": simulated.to_dict(),
            "max_abs_diff": max([abs(result.hit_rate - simulated.hit_rate)]
                                + [abs(a["hit_rate"] - b["hit_rate"]) for a, b in zip(result.tiers, simulated.tiers)])}


def _drive(trace: PreparedTrace, control, writer: NodeWriter, n_tiers: int, block_bytes: int,
           progress: Callable[[int], None] | None, prefetch_lead_s: float = 0.0, answers_at_finish: bool = False
           ) -> tuple[list[int], int, float]:
    """Per request: the cached run from the tiers, then the store (and the queued requests' prefetch); count
    the hits whose bytes are right, per tier."""
    hits = [0] * n_tiers
    wrong = 0
    ahead = 0  # requests up to here were prefetched
    tiers: dict[str, object] = {}
    started = time.perf_counter()
    for i, blocks in enumerate(trace.blocks):
        keys = [block_key(b) for b in blocks]
        ctx = request_context(trace, i, answer=not answers_at_finish)
        run = _read_run(control, tiers, keys)
        for key, (tier, data) in zip(keys, run):
            if np.array_equal(data, block_payload(key, block_bytes)):
                hits[tier] += 1
            else:
                wrong += 1
                break
        writer.store(keys, {k: block_payload(k, block_bytes) for k in keys[len(run):]}, ctx)
        if answers_at_finish and ctx.session:  # ordered after the store: the writer waited for it
            writer.answered(ctx.session, trace.finishes[i] if trace.finishes else "",
                            trace.output_tokens[i] if trace.output_tokens else 0)
        if prefetch_lead_s > 0 and n_tiers > 1:  # the simulator's order: after the request, its queue
            writer.flush()  # its blocks unpinned first, as the simulator never pins them
            ahead = max(ahead, i + 1)
            while ahead < len(trace.blocks) and trace.arrivals[ahead] <= ctx.now + prefetch_lead_s:
                ray.get(control.prefetch.remote([block_key(b) for b in trace.blocks[ahead]], ctx), timeout=120)
                ahead += 1
        if progress is not None:
            progress(1)
    writer.flush()
    return hits, wrong, time.perf_counter() - started


def _read_run(control, tiers: dict, keys: list[bytes]) -> list[tuple[int, np.ndarray]]:
    """The verified cached run of `keys` on the controller's node: where it says, read from each tier actor in
    one call, all in flight together; a block that does not verify ends the run and leaves the bookkeeping."""
    where = ray.get(control.lookup.remote(keys), timeout=120)
    groups: dict[str, list[int]] = {}
    for j, (_, name) in enumerate(where):
        groups.setdefault(name, []).append(j)
    refs = {}
    for name, js in groups.items():
        if name not in tiers:
            tiers[name] = ray.get_actor(name, namespace=NAMESPACE)
        refs[name] = tiers[name].get_many.remote([keys[j] for j in js])
    got: dict[int, np.ndarray | None] = {}
    for name, ref in refs.items():
        got.update(zip(groups[name], ray.get(ref, timeout=120)))
    run = []
    for j, (tier, _) in enumerate(where):
        if got[j] is None:  # missing or corrupt at its tier: a miss from here on
            ray.get(control.forget.remote([keys[j]]), timeout=120)
            break
        run.append((tier, got[j]))
    return run
