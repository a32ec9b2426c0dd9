"""The cluster's control plane as one actor: a cache manager per node, and the mover that runs their plans.

It holds `NodeCaches` (the managers, built by the simulator's own `build_hierarchy`)
bound to tier actors (`ActorTierIO`): every round of a plan is one call per tier
actor involved, issued together. Plans run one at a time, in the order they were
issued (a plan's sources are where the previous one left the blocks), so the
managers' view and the tiers' bytes agree after each call. Replicas commit their
requests here in one fire-and-forget call; the tiers make room only on its decisions.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Mapping, Sequence

import numpy as np
import ray

from kvcluster.block_index import shard_of
from kvcluster.cluster_control import NodeCaches
from kvcluster.gap_sync import GapCounts, GapSync, sync_all
from kvcluster.policies.base import RequestContext
from kvcluster.reuse_gap import GapModel
from kvcluster.simulator import TierPlan

from . import metrics
from .index_actor import NAMESPACE
from .peer_server import MEMORY_TIERS
from .predictor_actor import PREDICTOR_NAME

log = logging.getLogger(__name__)
CONTROL_NAME = "kvcluster/control"  # shard 0 (the only one unless sharded), detached, found by name


def control_name(shard: int) -> str:
    return CONTROL_NAME if shard == 0 else f"{CONTROL_NAME}/{shard}"
CALL_TIMEOUT_S = 120.0


class ActorTierIO:
    """Tier index -> tier actor; each round is one remote call per tier actor, gathered together.

    Memory tiers (dram, cxl) lend their pool over NIXL: another node's tier can `pull` from them
    directly (`nixl_source`), which is how migrations between nodes travel."""

    def __init__(self, actors: Sequence, names: Sequence[str]) -> None:
        self.actors = list(actors)
        self.names = list(names)

    def nixl_source(self, tier: int) -> str | None:
        return self.names[tier] if self.names[tier].rsplit("/", 1)[-1] in MEMORY_TIERS else None

    def pull(self, tier: int, source: str, keys: list[bytes]) -> list[bool | None]:
        got = self._gather({tier: self.actors[tier].pull.remote(source, keys)}, lambda t: [None] * len(keys))
        return got[tier]

    def _gather(self, calls: dict[int, ray.ObjectRef], failed) -> dict:
        """Each tier's answer; a tier actor that died or timed out answers `failed(tier)` (nothing read,
        nothing written), so the rest of the plan still runs and the manager learns which blocks missed.
        A round that raised halfway would leave the tiers and the bookkeeping apart."""
        out = {}
        for tier, ref in calls.items():
            try:
                out[tier] = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("tier actor %s unavailable (%s): its part of the plan is a miss", self.names[tier],
                            type(exc).__name__)
                out[tier] = failed(tier)
        return out

    def read(self, keys: Mapping[int, list[bytes]], out=None):
        return self._gather({t: self.actors[t].read_verified.remote(ks) for t, ks in keys.items()},
                            lambda t: ([None] * len(keys[t]), [None] * len(keys[t])))

    def delete(self, keys: Mapping[int, list[bytes]]) -> None:
        self._gather({t: self.actors[t].delete.remote(ks) for t, ks in keys.items()}, lambda t: 0)

    def write(self, items):
        # positional: keys, payloads, pairs, prefetch, digests (the plan's deletes made the room)
        return self._gather({t: self.actors[t].put_many.remote(ks, ps, None, False, ds)
                             for t, (ks, ps, ds) in items.items()}, lambda t: [False] * len(items[t][0]))


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class ControlPlaneActor:
    def __init__(self, chains: dict[str, list[tuple[str, str, int]]], policy: str,
                 policy_options: dict | None = None, block_bytes: int = 0, gap_sync_every: int = 0,
                 shard: int = 0, shards: int = 1) -> None:
        """`chains[node]`: that node's hierarchy as (label, tier actor name, capacity in blocks), fastest
        first; `block_bytes`: a block's payload, for the bytes-moved metric. On a restart it rebuilds its
        view from what the tier actors hold. `gap_sync_every` > 0: every that many commits (and once at
        start) the policies' reuse-gap counts are pooled with the cluster's through the predictor actor
        (`kvcluster.gap_sync`), so each node learns from all and a restart starts from what was learnt.
        `shard` of `shards`: this actor owns the blocks whose key hashes to it, and `chains` give its share
        of every tier (`kvcluster.sharded_hierarchy`); it adopts only its own blocks."""
        self.block_bytes = block_bytes
        self.shard, self.shards = shard, shards
        self.policy = policy
        self.labels = {node: [label for label, _, _ in chain] for node, chain in chains.items()}
        io = {node: ActorTierIO([ray.get_actor(name, namespace=NAMESPACE) for _, name, _ in chain],
                                [name for _, name, _ in chain])
              for node, chain in chains.items()}
        plans = {node: [TierPlan(label, cap) for label, _, cap in chain] for node, chain in chains.items()}
        self.io = io
        self.caches = NodeCaches(plans, io, policy, policy_options)
        self.requests = 0
        self.resyncs = 0
        self.adopted = self._adopt(io)
        self.gap_every = gap_sync_every
        self.gap_syncs = [GapSync(p.model) for m in self.caches.managers.values()
                          if isinstance(getattr(p := m.hierarchy.policies[0], "model", None), GapModel)]
        self.gap_synced = 0
        if self.gap_every:
            self._sync_gap()
        if ray.get_runtime_context().was_current_actor_reconstructed:
            metrics.faults().inc(1, {"component": "control", "kind": "restarted"})

    def shard_count(self) -> int:
        return self.shards

    def _mine(self, keys: list[bytes]) -> list[bytes]:
        """The keys this shard owns (all of them when unsharded)."""
        return keys if self.shards == 1 else [k for k in keys if shard_of(k, self.shards) == self.shard]

    def _sync_gap(self) -> None:
        """One round trip to the predictor: this control plane's new counts in, the cluster's totals back.
        Without a predictor the policies keep learning alone (a delta not sent is sent next time)."""
        if not self.gap_syncs:
            return
        try:
            predictor = ray.get_actor(PREDICTOR_NAME, namespace=NAMESPACE)
            sync_all(self.gap_syncs, lambda delta: ray.get(predictor.merge_gap.remote(delta), timeout=CALL_TIMEOUT_S))
            self.gap_synced += 1
        except (ValueError, ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("reuse-gap counts not pooled this round (%s)", type(exc).__name__)

    def _adopt(self, io: dict[str, ActorTierIO]) -> int:
        """Blocks the tiers already hold (from before a restart): back into the bookkeeping; what the policy
        cannot keep is deleted, so the tiers hold exactly what the managers say."""
        adopted = 0
        for node, tier_io in io.items():
            held = ray.get([a.held_keys.remote() for a in tier_io.actors], timeout=CALL_TIMEOUT_S)
            for tier, keys in enumerate(map(self._mine, held)):
                if not keys:
                    continue
                extra = self.caches.adopt(node, tier, keys)
                if extra:
                    tier_io.delete({tier: extra})
                adopted += len(keys) - len(extra)
        return adopted

    def resync(self, tier_actor: str) -> int:
        """A tier actor restarted: forget what its tier held and adopt what it holds now. Runs between
        plans (one call at a time), so no plan sees the tier half-known. Returns the blocks adopted."""
        for node, tier_io in self.io.items():
            if tier_actor in tier_io.names:
                tier = tier_io.names.index(tier_actor)
                keys = self._mine(ray.get(tier_io.actors[tier].held_keys.remote(), timeout=CALL_TIMEOUT_S))
                extra = self.caches.resync(node, tier, keys)
                if extra:
                    tier_io.delete({tier: extra})
                self.resyncs += 1
                return len(keys) - len(extra)
        return 0

    def commit(self, node: str, keys: list[bytes], payloads: list[np.ndarray | None],
               ctx: RequestContext | None = None) -> int:
        """A replica on `node` served a request: `payloads[j]` is block j's KV when it computed it (None
        when it read it). Places the request and moves the bytes; returns the blocks that failed."""
        self.requests += 1
        held = {k: (p, None) for k, p in zip(keys, payloads) if p is not None}
        migrating = {k for k in keys if k not in held and self.caches.managers[node].tier_of(k) is None}
        plan, failed = self.caches.commit(node, keys, held, ctx)
        manager = self.caches.managers[node]
        manager.drain_events()
        self._account(node, plan, set(failed), migrating)
        metrics.control_tracked().set(manager.tracked(), {"node": node, "kind": "keys"})
        metrics.control_tracked().set(manager.sessions_known(), {"node": node, "kind": "sessions"})
        if self.gap_every and self.requests % self.gap_every == 0:
            self._sync_gap()
        return len(failed)

    def answered(self, node: str, session: str, finish: str, output_tokens: int) -> None:
        """How the answer to `session`'s latest request on `node` ended, told after its `commit`: `node`'s
        policies re-class its blocks (no block moves)."""
        manager = self.caches.managers.get(node)
        if manager is not None:
            manager.answered(session, finish, output_tokens)

    def _account(self, node: str, plan, failed: set[bytes], migrating: set[bytes]) -> None:
        """Bytes moved and evictions of one plan, per (source, destination) tier, in a few counter calls."""
        labels = self.labels[node]
        moved: Counter = Counter()
        evicted: Counter = Counter()
        for m in plan.moves:
            if m.key in failed:
                continue
            if m.dst is None:
                evicted[labels[m.src]] += 1
                continue
            if m.src is not None and m.dst > m.src:
                evicted[labels[m.src]] += 1
            how = "migrate" if m.key in migrating else "store" if m.src is None else \
                "demote" if m.dst > m.src else "promote"
            src = "replica" if how == "store" else "other node" if how == "migrate" else labels[m.src]
            moved[(src, labels[m.dst], how)] += 1
        for (src, dst, how), n in moved.items():
            if self.block_bytes > 0:  # unknown block size (a bare control plane): blocks still count as evictions
                metrics.bytes_moved().inc(n * self.block_bytes, {"src": src, "dst": dst, "how": how})
        for label, n in evicted.items():
            where, tier = label.split("/", 1)
            metrics.evictions().inc(n, {"node": where, "tier": tier, "unit": "block"})

    def prefetch(self, node: str, keys: list[bytes], ctx: RequestContext | None = None) -> int:
        """A request queued for `node` (the ingress saw it wait, or a replay's look-ahead): lift its held
        prefix into the node's first tier before it runs. Returns the blocks promoted."""
        promoted = self.caches.prefetch(node, keys, ctx)
        self.caches.managers[node].drain_events()
        return promoted

    def serve(self, node: str, keys: list[bytes], payloads: list[np.ndarray], ctx: RequestContext | None = None
              ) -> tuple[list[int], list[np.ndarray]]:
        """A replay's request: the verified cached run on `node` (tier index and bytes of each block), then
        its placement, with `payloads[j]` standing in for block j's computed KV past the run."""
        self.requests += 1
        got = self.caches.fetch(node, keys)
        n = len(got.payloads)
        held = {k: (p, d) for k, p, d in zip(keys, got.payloads, got.digests)}
        held.update((k, (p, None)) for k, p in zip(keys[n:], payloads[n:]) if k not in held)
        self.caches.commit(node, keys, held, ctx)
        self.caches.managers[node].drain_events()
        return list(got.tiers), list(got.payloads)

    def stats(self) -> dict:
        return {"policy": self.policy, "shard": self.shard, "shards": self.shards, "tiers": self.labels,
                "requests": self.requests, "adopted": self.adopted,
                "resyncs": self.resyncs, "gap_syncs": self.gap_synced,
                "gap_learned_uses": sum(GapCounts(s.model.reached, s.model.reused).total_reached()
                                        for s in self.gap_syncs),
                **self.caches.stats()}
