"""A trace replayed live over N Ray nodes with a pooled tier: `cluster_sim.replay_cluster` on real bytes.

Each node gets its node-local tier actors (its 1/N share of every local tier,
`start_tier_actor`) and its controller (`NodeControlActor`, pinned to it, as
`kvcluster cluster up` starts them); the pool gets its manager
(`PoolManagerActor`, metadata only) and its storage: one directory of the
shared filesystem that every node reads and writes (`pfs`, location "pfs"), or
DRAM each node lends to the pool (`dram`: a memory tier actor
`kvcluster/<node>/pool` per node, its name the location; a node writes its pool
blocks into its own share and reads any node's share over NIXL, straight from
the share's registered slab, as replicas read a peer's dram tier).

Requests go to nodes by the simulator's `SessionRouter`. This process stands in
for every node's engine; per request, on its node:

1. `locate` on the node's controller and `lookup_access` on the pool's manager,
   in flight together: which blocks the node holds, which the pool holds and
   where, and what this request writes into the pool and deletes from it.
2. The hit run (each block local, else in the pool; the simulator's rule) read
   from the node's tier actors and the pool's storage, every byte compared with
   what the block's key derives (`live_replay.block_payload`).
3. The blocks the node does not hold (the pool's hits copied up, the misses
   computed) stored through the node's `NodeWriter`; the pool's victims deleted
   and its new blocks written through, straight into its storage.

No KV byte is an argument of a controller's or the pool manager's call (both
count any: `payload_bytes`). The simulated figures of the same trace, plan and
routing print beside the live ones.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvcluster.cluster_sim import ClusterPlan, ClusterResult, replay_cluster, split_capacity
from kvcluster.policies.registry import POLICIES
from kvcluster.session_routing import SessionRouter
from kvcluster.simulator import PreparedTrace, request_context
from kvcluster.storage import PFSBackend, RDMABackend, StorageError

from .deploy import start_tier_actor
from .index_actor import INDEX_NAME, NAMESPACE, IndexActor
from .live_replay import block_key, block_payload
from .node_control_actor import NodeControlActor, control_name
from .node_writer import NodeWriter
from .peer_control import ActorPeerControl
from .pool_manager_actor import POOL_MANAGER_NAME, PoolManagerActor
from .tier_actor import TierActor, TierActorConfig, actor_name

LOCAL_KINDS = ("dram", "cxl", "nvme")  # the tier actor kind of each node-local tier of the plan, fastest first
TIMEOUT_S = 120.0
# a share that will not answer again: its actor died, or its restart has no node to run on (its node is gone)
GONE = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnschedulableError)


class SharedFilePool:
    """The pool's storage as one shared-filesystem directory: one location ("pfs") that every node reads and
    writes. Its capacity is the pool's: a write the manager did not make room for is refused, not kept."""

    def __init__(self, root: Path, capacity_blocks: int, block_bytes: int) -> None:
        self.root = root
        self.backend = PFSBackend(root, capacity_blocks * block_bytes)

    def start(self, names: Sequence[str], ray_nodes: Sequence[str], capacity_blocks: int, block_bytes: int) -> list:
        return []

    def location(self, node: str) -> str:
        return "pfs"

    def close(self) -> None:
        """Nothing is held open between calls: each read and write opens its files."""

    def read(self, groups: dict[str, list[bytes]]) -> tuple[dict[bytes, np.ndarray | None], list[str]]:
        """The blocks of each location (None: missing or corrupt), and the locations found dead (none here)."""
        return {k: v for keys in groups.values() for k, v in zip(keys, self.backend.get_many(keys))}, []

    def write(self, at: str, keys: list[bytes], payloads: list[np.ndarray], delete: dict[str, list[bytes]]
              ) -> tuple[list[bytes], list[str]]:
        """Victims deleted first (their room), then the new blocks; returns the keys refused and the locations
        found dead (none here: the directory outlives any node)."""
        for gone in delete.values():
            self.backend.delete(gone)
        ok = self.backend.put_many(list(zip(keys, payloads))) if keys else []
        return [k for k, good in zip(keys, ok) if not good], []


class LentDramPool:
    """The pool's storage as DRAM each node lends: a memory tier actor `kvcluster/<node>/pool` per node, whose
    name is its location. A node writes into its own share; it reads any share over NIXL (one reader per share,
    its metadata exchanged once), or, where NIXL cannot (not installed, the share unreachable), through the
    share's actor, which also tells a share whose node died (`dead`): the manager forgets what it held."""

    STAGING_BLOCKS = 64  # a NIXL reader's staging buffer, in blocks; larger reads go in batches of it

    def __init__(self) -> None:
        self.shares: dict[str, object] = {}
        self.readers: dict[str, RDMABackend | None] = {}
        self.block_bytes = 0
        self.counters = {"nixl_blocks": 0, "actor_blocks": 0}

    @staticmethod
    def share_name(node: str) -> str:
        return f"kvcluster/{node}/pool"

    def start(self, names: Sequence[str], ray_nodes: Sequence[str], capacity_blocks: int, block_bytes: int) -> list:
        """One share per node, each able to hold the whole pool (the manager bounds the total)."""
        self.block_bytes = block_bytes
        for name, node_id in zip(names, ray_nodes):
            cfg = TierActorConfig.of(node=f"{name}-pool", kind="dram", slots=capacity_blocks, slot_bytes=block_bytes)
            pinned = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            self.shares[self.share_name(name)] = TierActor.options(
                name=self.share_name(name), namespace=NAMESPACE, scheduling_strategy=pinned).remote(cfg.model_dump())
        return list(self.shares.values())

    def location(self, node: str) -> str:
        return self.share_name(node)

    def _reader(self, at: str) -> RDMABackend | None:
        if at not in self.readers:
            try:
                self.readers[at] = RDMABackend(ActorPeerControl(self.shares[at], timeout_s=TIMEOUT_S),
                                               self.STAGING_BLOCKS * self.block_bytes, 1, name=f"kvc-pool-{at}")
            except StorageError:  # NIXL missing, or the share gone: its actor answers (or says it is dead)
                self.readers[at] = None
        return self.readers[at]

    def read(self, groups: dict[str, list[bytes]]) -> tuple[dict[bytes, np.ndarray | None], list[str]]:
        """Each share's blocks (None: missing, corrupt, or its share unreachable), and the shares found dead:
        their node is gone, and so is everything they held."""
        out: dict[bytes, np.ndarray | None] = {}
        by_actor = {}
        for at, keys in groups.items():
            reader = self._reader(at) if at in self.shares else None
            if reader is None:
                by_actor[at] = keys
                continue
            results: list[np.ndarray | None] = [None] * len(keys)
            try:
                reader.read_into(keys, None, results, raise_unavailable=True)
            except StorageError:  # unreachable over NIXL: its actor tells a dead share from a slow one
                self.readers.pop(at).close()
                by_actor[at] = keys
                continue
            out.update(zip(keys, results))
            self.counters["nixl_blocks"] += sum(r is not None for r in results)
        refs = {at: self.shares[at].get_many.remote(keys) for at, keys in by_actor.items() if at in self.shares}
        dead = []
        for at, keys in by_actor.items():
            got = [None] * len(keys)
            try:
                got = ray.get(refs[at], timeout=TIMEOUT_S) if at in refs else got
            except GONE:
                dead.append(at)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # unreachable for now: misses, the share may answer again
            out.update(zip(keys, got))
            self.counters["actor_blocks"] += sum(g is not None for g in got)
        return out, dead

    def close(self) -> None:
        for reader in self.readers.values():
            if reader is not None:
                reader.close()
        self.readers.clear()

    def write(self, at: str, keys: list[bytes], payloads: list[np.ndarray], delete: dict[str, list[bytes]]
              ) -> tuple[list[bytes], list[str]]:
        refs = {where: self.shares[where].delete.remote(gone) for where, gone in delete.items()
                if where != at and where in self.shares}
        put = self.shares[at].put_many.remote(keys, payloads, None, False, None, delete.get(at)) if keys or \
            delete.get(at) else None
        dead = []
        for where, ref in refs.items():
            try:
                ray.get(ref, timeout=TIMEOUT_S)
            except GONE:
                dead.append(where)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # its victims stay there a while: never served, the manager no longer counts them
        try:
            ok = ray.get(put, timeout=TIMEOUT_S) if put is not None else []
        except GONE:
            ok, dead = [False] * len(keys), dead + [at]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            ok = [False] * len(keys)
        return [k for k, good in zip(keys, ok) if not good], dead


def replay_cluster_live(trace: PreparedTrace, policy: str, plan: ClusterPlan, ray_nodes: Sequence[str], *,
                        pool_storage: str = "pfs", block_bytes: int = 512, pool_policy: str | None = None,
                        progress: Callable[[int], None] | None = None) -> dict:
    """Replay `trace` over `len(ray_nodes)` nodes (one Ray node id each, hex) with `plan`'s node-local tiers
    split over them and its pool shared; returns the live and the simulated `ClusterResult`s, the bytes read
    that differed from what their keys derive (`wrong_bytes`), the KV bytes that reached a control call, and the
    pool manager's counters."""
    nodes = len(ray_nodes)
    if policy not in POLICIES or POLICIES[policy].offline:
        raise ValueError(f"policy: {policy!r} is not an online policy")
    if plan.pool is None:
        raise ValueError("plan.pool: the live cluster replay needs a pooled tier")
    if not 1 <= len(plan.local) <= len(LOCAL_KINDS):
        raise ValueError(f"plan.local: 1 to {len(LOCAL_KINDS)} node-local tiers ({', '.join(LOCAL_KINDS)})")
    if pool_storage not in ("pfs", "dram"):
        raise ValueError(f"pool_storage: 'pfs' or 'dram', got {pool_storage!r}")
    if block_bytes < 512 or block_bytes % 512:
        raise ValueError(f"block_bytes must be a positive multiple of 512, got {block_bytes}")
    shares = [split_capacity(t.capacity_blocks, nodes, f"plan.local {t.name!r}") for t in plan.local]
    names = [f"node{i}" for i in range(nodes)]
    scratch = Path(tempfile.mkdtemp(prefix="kvcluster-live-cluster-"))
    started, storage = [], None
    try:
        try:
            ray.get_actor(INDEX_NAME, namespace=NAMESPACE)  # the tier actors report to it
        except ValueError:
            started.append(IndexActor.options(name=INDEX_NAME, namespace=NAMESPACE).remote())
        chains = {}
        for i, (name, node_id) in enumerate(zip(names, ray_nodes)):
            chains[name] = []
            for t, kind, share in zip(plan.local, LOCAL_KINDS, shares):
                path = str(scratch / "nvme") if kind == "nvme" else None
                tc = TierActorConfig.of(node=name, kind=kind, slots=share[i], slot_bytes=block_bytes, path=path)
                started.append(start_tier_actor(tc, node_id))
                chains[name].append((f"{name}/{t.name}", actor_name(name, kind), tc.slots))
        storage = SharedFilePool(scratch / "pool", plan.pool.capacity_blocks, block_bytes) if pool_storage == "pfs" \
            else LentDramPool()
        started += storage.start(names, ray_nodes, plan.pool.capacity_blocks, block_bytes)
        ray.get([a.describe.remote() for a in started[1:] if a is not None], timeout=TIMEOUT_S)
        controls = [NodeControlActor.options(
            name=control_name(name), namespace=NAMESPACE,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(name, chains[name], policy, None, block_bytes, 0) for name, node_id in zip(names, ray_nodes)]
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        files = (str(storage.root), "pfs") if pool_storage == "pfs" else None  # what it adopts if it restarts
        shares = list(storage.shares) if pool_storage == "dram" else None
        manager = PoolManagerActor.options(name=POOL_MANAGER_NAME, namespace=NAMESPACE, scheduling_strategy=here
                                           ).remote(pool_policy or policy, plan.pool.capacity_blocks, None, files,
                                                    shares)  # on this node: not on one that may go
        started += controls + [manager]
        ray.get([c.stats.remote() for c in controls] + [manager.stats.remote()], timeout=TIMEOUT_S)
        driver = _Driver(names, controls, manager, storage, block_bytes)
        live = driver.run(trace, policy, progress)
        control_payload = sum(s["payload_bytes"] for s in ray.get([c.stats.remote() for c in controls],
                                                                   timeout=TIMEOUT_S))
        pool_stats = ray.get(manager.stats.remote(), timeout=TIMEOUT_S)
    finally:
        if storage is not None:
            storage.close()
        for actor in started:
            ray.kill(actor, no_restart=True)
        shutil.rmtree(scratch, ignore_errors=True)
    simulated = replay_cluster(trace, policy, plan, nodes, pool_policy=pool_policy)
    return {"driver": "live", "nodes": nodes, "pool_storage": pool_storage, "block_bytes": block_bytes,
            "wrong_bytes": driver.wrong_bytes, "control_payload_bytes": control_payload,
            "pool_payload_bytes": pool_stats["payload_bytes"], "pool": pool_stats,
            "pool_reads": dict(getattr(storage, "counters", {})),
            "misses_on_read": driver.missing, "pool_unavailable": driver.pool_unavailable, "live": live.to_dict(), "simulated": simulated.to_dict(),
            "max_abs_diff": max(abs(live.hit_rate - simulated.hit_rate),
                                abs(live.local_share - simulated.local_share))}


class _Driver:
    """Every node's engine, one request at a time."""

    def __init__(self, names: list[str], controls: list, manager, storage, block_bytes: int) -> None:
        self.names, self.controls, self.manager, self.storage = names, controls, manager, storage
        self.writers = [NodeWriter(name) for name in names]
        self.block_bytes = block_bytes
        self.tiers: dict[str, object] = {}
        self.wrong_bytes = 0
        self.missing = 0  # blocks the bookkeeping placed somewhere that did not come back (misses from there)
        self.pool_unavailable = 0  # requests served without the pool: its manager died with their call

    def run(self, trace: PreparedTrace, policy: str, progress: Callable[[int], None] | None) -> ClusterResult:
        router = SessionRouter(len(self.names))
        served = [0] * len(self.names)
        local_total = pool_total = 0
        started = time.perf_counter()
        for i, blocks in enumerate(trace.blocks):
            node = router.route(trace.sessions[i], blocks, trace.arrivals[i])
            served[node] += 1
            local_hits, pool_hits = self.serve(node, [block_key(b) for b in blocks], request_context(trace, i))
            local_total += local_hits
            pool_total += pool_hits
            if progress is not None:
                progress(1)
        for writer in self.writers:
            writer.flush()
        hits = local_total + pool_total
        return ClusterResult(trace=trace.name, nodes=len(self.names), policy=policy, pooled=True,
                             hit_rate=hits / max(1, trace.block_refs), local_share=local_total / hits if hits else 0.0,
                             block_refs=trace.block_refs, local_hits=local_total, pool_hits=pool_total,
                             requests_per_node_max=max(served), seconds=time.perf_counter() - started)

    def serve(self, node: int, keys: list[bytes], ctx) -> tuple[int, int]:
        at = self.storage.location(self.names[node])
        local_ref = self.controls[node].locate.remote(keys)
        pool_ref = self.manager.lookup_access.remote(keys, ctx, at)
        local = ray.get(local_ref, timeout=TIMEOUT_S)
        try:
            where, write, delete = ray.get(pool_ref, timeout=TIMEOUT_S)
        except ray.exceptions.RayActorError:  # the manager died with the call: the pool is a miss this request
            where, write, delete = [None] * len(keys), [], {}
            self.pool_unavailable += 1
        run = []
        for j, (here, there) in enumerate(zip(local, where)):
            if here is None and there is None:
                break
            run.append(j)
        have, local_hits, pool_hits = self.read(node, keys, run, local, where)
        # what the node does not hold: the pool's hits, copied up with the bytes read, and the misses, computed
        self.writers[node].store(keys, {k: self.payload(k, have) for k, here in zip(keys, local) if here is None},
                                 ctx)
        failed, dead = self.storage.write(at, write, [self.payload(k, have) for k in write], delete)
        for location in dead:
            self._tell_manager("lost", location)
        if failed:
            self._tell_manager("forget", failed)
        return local_hits, pool_hits

    def read(self, node: int, keys: list[bytes], run: list[int], local: list, where: list
             ) -> tuple[dict[bytes, np.ndarray], int, int]:
        """The run's bytes, from the node's tier actors and the pool's storage, all in flight together; counted
        up to the first block that does not come back right."""
        from_tiers: dict[str, list[bytes]] = {}
        from_pool: dict[str, list[bytes]] = {}
        for j in run:
            if local[j] is not None:
                from_tiers.setdefault(local[j][1], []).append(keys[j])
            else:
                from_pool.setdefault(where[j], []).append(keys[j])
        refs = {name: self._tier(name).get_many.remote(ks) for name, ks in from_tiers.items()}
        got, dead = self.storage.read(from_pool) if from_pool else ({}, [])
        for location in dead:  # a node gone with its share: the pool forgets everything it held there
            self._tell_manager("lost", location)
        for name, ref in refs.items():
            got.update(zip(from_tiers[name], ray.get(ref, timeout=TIMEOUT_S)))
        have: dict[bytes, np.ndarray] = {}
        counts = [0, 0]
        for j in run:
            key, data = keys[j], got[keys[j]]
            if data is None:  # gone from where the bookkeeping said: it leaves it, a miss from here on
                self.missing += 1
                if local[j] is not None:
                    ray.get(self.controls[node].forget.remote([key]), timeout=TIMEOUT_S)
                    local[j] = None
                elif where[j] not in dead:
                    self._tell_manager("forget", [key])
                break
            expected = block_payload(key, self.block_bytes)
            if not np.array_equal(data, expected):
                self.wrong_bytes += int(np.count_nonzero(np.asarray(data).reshape(-1)[:expected.size] != expected)
                                        if np.asarray(data).size == expected.size else expected.size)
                break
            have[key] = data
            counts[local[j] is None] += 1
        return have, counts[0], counts[1]

    def _tell_manager(self, method: str, arg) -> None:
        """A loss or a failed block, told to the pool's manager. One that died meanwhile needs no telling: it
        restarts from what the pool's directory holds (or empty, over lent DRAM)."""
        try:
            ray.get(getattr(self.manager, method).remote(arg), timeout=TIMEOUT_S)
        except ray.exceptions.RayActorError:
            self.pool_unavailable += 1

    def payload(self, key: bytes, have: dict[bytes, np.ndarray]) -> np.ndarray:
        """A block's bytes on the node: read this request, else computed (derived from its key)."""
        data = have.get(key)
        return block_payload(key, self.block_bytes) if data is None else data

    def _tier(self, name: str):
        if name not in self.tiers:
            self.tiers[name] = ray.get_actor(name, namespace=NAMESPACE)
        return self.tiers[name]
