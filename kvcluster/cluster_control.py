"""The control plane of a cluster: one cache manager per node, one policy everywhere.

Each node's blocks form one hierarchy over that node's own tiers, fastest first
(dram, cxl, nvme), ending in its share of the shared filesystem (a pfs directory
several nodes mount is split evenly among them, so the shares never add up to more
than it holds). A block lives in exactly one node's hierarchy. When a replica on
node B commits a request that used a block another node holds, the block migrates:
its bytes are read from that node's tier, placed by B's manager, and only then
deleted at the source. So a session's blocks follow it to the node serving it,
and every placement, eviction and migration is the configured policy's decision.

Pure logic over `TierIO`s: the Ray side binds each node's tier actors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from .cache_manager import CacheManager, StorePlan
from .cluster_config import ClusterConfig
from .control_plane import ControlPlane, Fetched
from .plan_executor import Held, TierIO, execute
from .policies.base import RequestContext
from .simulator import TierPlan
from .tiers import TIER_ORDER, TierSpec


@dataclass(frozen=True)
class ChainTier:
    node: str
    tier: TierSpec
    capacity_blocks: int  # the share this node's hierarchy may fill

    @property
    def label(self) -> str:
        return f"{self.node}/{self.tier.tier}"

    def plan(self) -> TierPlan:
        return TierPlan(self.label, self.capacity_blocks)


def node_chains(cfg: ClusterConfig, slots: Mapping[tuple[str, str], int] | None = None) -> dict[str, list[ChainTier]]:
    """Each node's tiers, fastest first, with the capacity its hierarchy may use. `slots[(node, tier)]`
    overrides a tier's blocks (default: the cluster's GiB / block bytes)."""
    def cap(node: str, tier: TierSpec) -> int:
        return slots[(node, tier.tier)] if slots and (node, tier.tier) in slots else cfg.slots(tier)

    sharers = Counter(t.path for n in cfg.nodes for t in n.tiers if t.tier == "pfs")
    chains = {}
    for node in cfg.nodes:
        chain = []
        for tier in sorted(node.tiers, key=lambda t: TIER_ORDER.index(t.tier)):
            blocks = cap(node.name, tier)
            if tier.tier == "pfs":
                blocks //= sharers[tier.path]
            chain.append(ChainTier(node.name, tier, max(1, blocks)))
        chains[node.name] = chain
    return chains


class NodeCaches:
    def __init__(self, chains: Mapping[str, Sequence[TierPlan]], io: Mapping[str, TierIO], policy: str,
                 policy_options: dict | None = None) -> None:
        """`chains[node]`: that node's tiers, fastest first (`ChainTier.plan()` of `node_chains`)."""
        self.chains = {node: list(chain) for node, chain in chains.items()}
        self.io = dict(io)
        self.managers = {node: CacheManager(chain, policy, policy_options=policy_options)
                         for node, chain in self.chains.items()}
        self.planes = {node: ControlPlane(m, self.io[node]) for node, m in self.managers.items()}
        self.totals: Counter = Counter()

    def fetch(self, node: str, keys: Sequence[bytes]) -> Fetched:
        """The verified run of `keys` in `node`'s hierarchy (a replay's reads; replicas read tiers directly)."""
        return self.planes[node].fetch(keys)

    def commit(self, node: str, keys: Sequence[bytes], held: Held, ctx: RequestContext | None = None
               ) -> tuple[StorePlan, list[bytes]]:
        """Place one request served on `node`: `held` are the payloads its replica computed (or read).
        Blocks of the request that another node holds and the replica did not send migrate here:
        pulled node to node where both sides speak NIXL (the source a memory tier), else read here
        and written there."""
        manager = self.managers[node]
        held = dict(held)
        sources = self._foreign(node, keys, held)
        pulls = self._pullable(node, sources)
        if sources:
            self._read_foreign({o: {t: ks for t, ks in by.items() if (o, t) not in pulls} for o, by in sources.items()},
                               held)
        arriving = {k: src for src, ks in pulls.items() for k in ks}
        plan = manager.prepare_store(keys, set(held) | set(arriving), ctx)
        rest = StorePlan(plan.plan_id, tuple(m for m in plan.moves if m.key not in arriving))
        failed = execute(rest, self.io[node], held)
        failed += self._pull(node, plan, arriving)
        manager.complete_store(plan, failed)
        moved_here = {m.key for m in plan.moves if m.dst is not None} - set(failed)
        self._release_foreign(sources, moved_here)
        self.totals["plans"] += 1
        self.totals["moves"] += len(plan.moves)
        self.totals["failed"] += len(failed)
        return plan, failed

    def prefetch(self, node: str, keys: Sequence[bytes], ctx: RequestContext | None = None) -> int:
        """A request queued for `node`: the part of its held prefix in `node`'s lower tiers moves up to its
        first tier now, so the request reads it from there. Returns the blocks promoted. Blocks only
        another node holds are left where they are: the request's own commit migrates them."""
        manager = self.managers[node]
        plan = manager.prepare_prefetch(keys, ctx)
        if not plan.moves:
            return 0
        failed = execute(plan, self.io[node], {})
        manager.complete_store(plan, failed)
        failed = set(failed)
        promoted = sum(1 for m in plan.moves if m.dst == 0 and m.src not in (None, 0) and m.key not in failed)
        self.totals["prefetched"] += promoted
        return promoted

    def _pullable(self, node: str, sources: dict[str, dict[int, list[bytes]]]) -> dict[tuple[str, int], list[bytes]]:
        """The (other node, tier) groups that `node`'s tiers can pull over NIXL."""
        if not hasattr(self.io[node], "pull"):
            return {}
        return {(other, tier): ks for other, by_tier in sources.items() for tier, ks in by_tier.items()
                if getattr(self.io[other], "nixl_source", lambda t: None)(tier) is not None}

    def _pull(self, node: str, plan: StorePlan, arriving: dict[bytes, tuple[str, int]]) -> list[bytes]:
        """Run the plan's migrations that come over NIXL: one pull per (destination tier, source tier),
        after the rest of the plan made their room."""
        groups: dict[tuple[int, tuple[str, int]], list[bytes]] = {}
        for m in plan.moves:
            if m.key in arriving and m.dst is not None:
                groups.setdefault((m.dst, arriving[m.key]), []).append(m.key)
        failed = []
        for (dst, (other, tier)), ks in groups.items():
            ok = self.io[node].pull(dst, self.io[other].nixl_source(tier), ks)
            failed.extend(k for k, good in zip(ks, ok) if good is not True)
            self.totals["pulled"] += sum(good is True for good in ok)
        return failed

    def _foreign(self, node: str, keys: Sequence[bytes], held: Held) -> dict[str, dict[int, list[bytes]]]:
        """Blocks of this request that only another node's hierarchy holds: {node: {tier: keys}}."""
        out: dict[str, dict[int, list[bytes]]] = {}
        mine = self.managers[node]
        for key in keys:
            if key in held or mine.tier_of(key) is not None:
                continue
            for other, manager in self.managers.items():
                tier = None if other == node else manager.tier_of(key)
                if tier is not None:
                    out.setdefault(other, {}).setdefault(tier, []).append(key)
                    break
        return out

    def _read_foreign(self, sources: dict[str, dict[int, list[bytes]]], held: dict) -> None:
        for other, by_tier in sources.items():
            for tier, (payloads, digests) in self.io[other].read(by_tier).items():
                for key, payload, digest in zip(by_tier[tier], payloads, digests):
                    if payload is not None:
                        held[key] = (payload, digest)

    def _release_foreign(self, sources: dict[str, dict[int, list[bytes]]], moved_here: set[bytes]) -> None:
        """The source copy goes only once the block reached a tier here: never in zero places."""
        for other, by_tier in sources.items():
            gone = {tier: [k for k in keys if k in moved_here] for tier, keys in by_tier.items()}
            gone = {tier: keys for tier, keys in gone.items() if keys}
            if not gone:
                continue
            manager = self.managers[other]
            for tier, keys in gone.items():
                manager.hierarchy.policies[tier].discard(manager._known_ids(keys))
            self.io[other].delete(gone)
            self.totals["migrated"] += sum(len(k) for k in gone.values())

    def adopt(self, node: str, tier: int, keys: Sequence[bytes]) -> list[bytes]:
        """Blocks a tier already holds (after this control plane restarted): back into the bookkeeping.
        Returns those the policy could not keep (the caller deletes them, so bytes and view agree)."""
        return self.managers[node].adopt(tier, keys)

    def resync(self, node: str, tier: int, keys: Sequence[bytes]) -> list[bytes]:
        """A tier that restarted holds `keys` now: the bookkeeping follows (its old blocks leave, these are
        adopted). Returns those to delete there."""
        manager = self.managers[node]
        manager.forget_tier(tier)
        return manager.adopt(tier, keys)

    def stats(self) -> dict:
        return {"nodes": {node: {"occupancy": m.occupancy(), "counters": m.counters(), "tracked_blocks": m.tracked(),
                                 "sessions": m.sessions_known(),
                                 "prefetch": m.prefetch_stats()}
                          for node, m in self.managers.items()},
                "totals": dict(self.totals)}
