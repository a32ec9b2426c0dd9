"""One node's control plane as an actor on that node: its `NodeController`, bound to its own tier actors.

Named `kvcluster/<node>/control` and pinned to the node, it decides for that
node's tiers only (dram, cxl, nvme, its share of pfs); another node's controller
never waits on it, and a node whose controller is down only loses its own
placements meanwhile (its writers' new blocks stay in their engines: misses
elsewhere, never wrong). Its calls carry keys, sizes, pairs and context; KV
bytes go writer -> tier and tier -> tier (`plan_mover`), and `stats()` counts any
payload that reached it as an argument (`payload_bytes`, 0 by design).

On a restart it rebuilds its view from what its tier actors hold (`adopt`);
every `gap_sync_every` stores its policies' reuse-gap counts are pooled with the
cluster's through the predictor actor, so statistics stay global.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import ray

from kvcluster.cache_manager import CacheManager
from kvcluster.gap_sync import GapCounts, GapSync, sync_all
from kvcluster.node_control import DEFAULT_LEASE_S, NodeController
from kvcluster.policies.base import RequestContext
from kvcluster.reuse_gap import GapModel
from kvcluster.hierarchy import TierPlan
from kvcluster.storage.base import tensor_type

from . import metrics
from .index_actor import NAMESPACE
from .plan_mover import CALL_TIMEOUT_S, RemoteMover
from .predictor_actor import PREDICTOR_NAME

log = logging.getLogger(__name__)
GAP_SYNC_MIN_S = 5.0


def control_name(node: str) -> str:
    return f"kvcluster/{node}/control"


def control_handle(node: str, namespace: str = NAMESPACE):
    """The running controller of `node`, found by name (ValueError when there is none)."""
    return ray.get_actor(control_name(node), namespace=namespace)


def payload_bytes(value) -> int:
    """Bytes of KV payload inside a call's arguments: arrays, tensors and byte strings longer than a key."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, tensor_type()):
        return value.numel() * value.element_size()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value) if len(value) > 64 else 0
    if isinstance(value, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        if all(type(v) is bytes for v in value):  # a list of keys, the common case: lengths only
            return sum(n for n in map(len, value) if n > 64)
        return sum(payload_bytes(v) for v in value)
    return 0


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class NodeControlActor:
    def __init__(self, node: str, chain: list[tuple[str, str, int]], policy: str, policy_options: dict | None = None,
                 block_bytes: int = 0, gap_sync_every: int = 0, lease_s: float = DEFAULT_LEASE_S,
                 gap_sync_min_s: float = GAP_SYNC_MIN_S) -> None:
        """`chain`: the node's tiers as (label, tier actor name, capacity in blocks), fastest first;
        `block_bytes`: a block's payload, for the bytes-moved metric; the reuse-gap counts are pooled every
        `gap_sync_every` stores, and at most once per `gap_sync_min_s` seconds (a sync moves the whole count
        table both ways, ~100 KB for `bayes`: at a thousand nodes the predictor's inbound traffic is what this
        interval bounds, see docs/scaling.md)."""
        self.node, self.policy, self.block_bytes = node, policy, block_bytes
        self.labels = [label for label, _, _ in chain]
        self.mover = RemoteMover([ray.get_actor(name, namespace=NAMESPACE) for _, name, _ in chain],
                                 [name for _, name, _ in chain])
        manager = CacheManager([TierPlan(label, cap) for label, _, cap in chain], policy,
                               policy_options=policy_options, record_events=False)  # the index hears the tiers
        self.control = NodeController(manager, self.mover, lease_s)
        self.payload_bytes = 0
        self.adopted = self._adopt()
        self.resyncs = 0
        self.gap_every = gap_sync_every
        self.gap_min_s = gap_sync_min_s
        self._gap_at = float("-inf")
        first = manager.hierarchy.policies[0]  # the policy that sees every request
        self.gap_syncs = [GapSync(first.model)] if isinstance(getattr(first, "model", None), GapModel) else []
        self.gap_synced = 0
        if self.gap_every:
            self._sync_gap()
        if ray.get_runtime_context().was_current_actor_reconstructed:
            metrics.faults().inc(1, {"component": f"{node}/control", "kind": "restarted"})

    @property
    def manager(self) -> CacheManager:
        return self.control.manager

    def _guard(self, *args) -> None:
        self.payload_bytes += payload_bytes(args)

    # ---- stores: prepare (room made, destinations back), the caller writes, complete ---------------------

    def prepare_store(self, keys: list[bytes], new: list[bytes], ctx: RequestContext | None = None,
                      completed: tuple | None = None) -> tuple[int, list[tuple[str, list[bytes], list[bytes]]]]:
        """Place a request served on this node; returns the plan id and, per tier actor, the new blocks the
        caller writes there and the victims it deletes there first (in the same `put_many`). `completed`: the
        writer's previous store, `complete_store`'s arguments, carried here to save a call."""
        if completed is not None:
            self.complete_store(*completed)
        self._guard(keys, new, ctx)
        ticket = self.control.prepare_store(keys, new, ctx)
        self._account(len(new), sum(len(ks) for ks in ticket.writes.values()))
        if self.gap_every and self.control.counters["stores"] % self.gap_every == 0 \
                and time.monotonic() - self._gap_at >= self.gap_min_s:
            self._sync_gap()
        return ticket.plan_id, [(self.mover.names[t], ks, ticket.evict.get(t, []))
                                for t, ks in sorted(ticket.writes.items())]

    def complete_store(self, plan_id: int, written: list[tuple[str, list[bytes], list[bytes]]],
                       failed: list[bytes]) -> bool:
        """The writer put its ticket's blocks into `written`'s tier actors (after deleting their victims),
        except `failed`."""
        self._guard(written, failed)
        index = {name: t for t, name in enumerate(self.mover.names)}
        landed = {index[name]: keys for name, keys, _ in written if name in index}
        evicted = {index[name]: gone for name, _, gone in written if name in index and gone}
        done = self.control.complete_store(plan_id, failed, landed, evicted)
        metrics.control_tracked().set(self.manager.tracked(), {"node": self.node, "kind": "keys"})
        metrics.control_tracked().set(self.manager.sessions_known(), {"node": self.node, "kind": "sessions"})
        return done

    def _account(self, new: int, placed: int) -> None:
        if self.block_bytes > 0 and placed:
            metrics.bytes_moved().inc(placed * self.block_bytes, {"src": f"{self.node}/engine",
                                                                  "dst": self.labels[0], "how": "store"})
        self.manager.drain_events()

    # ---- reads by a replay driver, prefetch, answers ---------------------------------------------------------

    def lookup(self, keys: list[bytes]) -> list[tuple[int, str]]:
        """Tier index and tier actor of each block of the leading run this node holds."""
        self._guard(keys)
        return [(t, self.mover.names[t]) for t in self.manager.lookup(keys)]

    def locate(self, keys: list[bytes]) -> list[tuple[int, str] | None]:
        """Tier index and tier actor of every block of `keys` this node holds (None: not here), past the leading
        run too: a reader with a pool behind this node fills the run's gaps from the pool."""
        self._guard(keys)
        tiers = [self.manager.tier_of(k) for k in keys]
        return [None if t is None else (t, self.mover.names[t]) for t in tiers]

    def forget(self, keys: list[bytes]) -> None:
        """Blocks a reader found missing or corrupt: they leave the bookkeeping and their tier."""
        self._guard(keys)
        where: dict[int, list[bytes]] = {}
        for key in keys:
            tier = self.manager.tier_of(key)
            if tier is not None:
                where.setdefault(tier, []).append(key)
        self.manager.forget(keys)
        self.mover.delete(where)
        self.manager.drain_events()

    def prefetch(self, keys: list[bytes], ctx: RequestContext | None = None) -> int:
        """A request queued for this node: its held prefix lifted into the first tier before it runs."""
        self._guard(keys, ctx)
        plan = self.manager.prepare_prefetch(keys, ctx)
        if not plan.moves:
            return 0
        failed = set(self.mover.run(plan))
        self.manager.complete_store(plan, failed)
        self.manager.drain_events()
        return sum(1 for m in plan.moves if m.dst == 0 and m.src not in (None, 0) and m.key not in failed)

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        """How the answer to `session`'s latest request on this node ended: its blocks are re-classed."""
        self.manager.answered(session, finish, output_tokens)

    # ---- restarts -------------------------------------------------------------------------------------------

    def _adopt(self) -> int:
        """Blocks the tiers already hold (from before a restart): back into the bookkeeping; what the policy
        cannot keep is deleted, so the tiers hold exactly what the manager says."""
        held = ray.get([a.held_keys.remote() for a in self.mover.actors], timeout=CALL_TIMEOUT_S)
        adopted = 0
        for tier, keys in enumerate(held):
            if keys:
                extra = self.manager.adopt(tier, keys)
                if extra:
                    self.mover.delete({tier: extra})
                adopted += len(keys) - len(extra)
        return adopted

    def resync(self, tier_actor: str) -> int:
        """A tier actor of this node restarted: forget what it held and adopt what it holds now."""
        if tier_actor not in self.mover.names:
            return 0
        tier = self.mover.names.index(tier_actor)
        keys = ray.get(self.mover.actors[tier].held_keys.remote(), timeout=CALL_TIMEOUT_S)
        self.manager.forget_tier(tier)
        extra = self.manager.adopt(tier, keys)
        if extra:
            self.mover.delete({tier: extra})
        self.resyncs += 1
        return len(keys) - len(extra)

    def _sync_gap(self) -> None:
        """One round trip to the predictor: this node's new counts in, the cluster's totals back."""
        if not self.gap_syncs:
            return
        self._gap_at = time.monotonic()
        try:
            predictor = ray.get_actor(PREDICTOR_NAME, namespace=NAMESPACE)
            sync_all(self.gap_syncs, lambda delta: ray.get(predictor.merge_gap.remote(delta), timeout=CALL_TIMEOUT_S))
            self.gap_synced += 1
        except (ValueError, ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("reuse-gap counts not pooled this round (%s)", type(exc).__name__)

    def stats(self) -> dict:
        m = self.manager
        return {"node": self.node, "policy": self.policy, "tiers": self.labels, "adopted": self.adopted,
                "resyncs": self.resyncs, "gap_syncs": self.gap_synced, "in_flight": self.control.in_flight(),
                "payload_bytes": self.payload_bytes, **self.control.counters,
                "gap_learned_uses": sum(GapCounts(s.model.reached, s.model.reused).total_reached()
                                        for s in self.gap_syncs),
                "occupancy": m.occupancy(), "counters": m.counters(), "tracked_blocks": m.tracked(),
                "sessions": m.sessions_known(), "prefetch": m.prefetch_stats()}
