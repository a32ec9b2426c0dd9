"""Each node's tiers as its controller runs them: one hierarchy per node, one policy everywhere.

A node's blocks form one hierarchy over that node's own tiers, fastest first
(dram, cxl, nvme), ending in its share of the shared filesystem (a pfs directory
several nodes mount is split evenly among them, so the shares never add up to more
than it holds). Each node's controller (`kvcluster.node_control`) places its blocks
over that chain. A block another node holds and a request here reads is copied
here by the reader's store (the next turn finds it locally); the other node's copy
stays until its own policy lets it go.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from .cluster_config import ClusterConfig
from .hierarchy import TierPlan
from .tiers import TIER_ORDER, TierSpec


@dataclass(frozen=True)
class ChainTier:
    node: str
    tier: TierSpec
    capacity_blocks: int  # the share this node's hierarchy may fill

    @property
    def label(self) -> str:
        return f"{self.node}/{self.tier.kind}"

    def plan(self) -> TierPlan:
        return TierPlan(self.label, self.capacity_blocks)


def node_chains(cfg: ClusterConfig, slots: Mapping[tuple[str, str], int] | None = None) -> dict[str, list[ChainTier]]:
    """Each node's tiers, fastest first, with the capacity its hierarchy may use. `slots[(node, tier)]`
    overrides a tier's blocks (default: the tier's usable bytes / block bytes)."""
    def cap(node: str, tier: TierSpec) -> int:
        return slots[(node, tier.kind)] if slots and (node, tier.kind) in slots else cfg.slots(tier)

    sharers = Counter(t.path for n in cfg.nodes for t in n.tiers if t.kind == "pfs")
    chains = {}
    for node in cfg.nodes:
        chain = []
        for tier in sorted(node.tiers, key=lambda t: TIER_ORDER.index(t.kind)):
            blocks = cap(node.name, tier)
            if tier.kind == "pfs":
                blocks //= sharers[tier.path]
            chain.append(ChainTier(node.name, tier, max(1, blocks)))
        chains[node.name] = chain
    return chains
