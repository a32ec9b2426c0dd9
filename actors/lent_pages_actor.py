"""An engine's paged KV lent to the cluster as its node's hbm tier: the control side of the NIXL peer protocol.

The engine registers its paged KV with a NIXL agent of its own (`NixlRegionLender`) and reports, one call per
engine step, which blocks its pages hold (`update`). This actor keeps that directory (`LentDirectory`),
answers readers' `connect` and `lookup` (`PeerServer`), and tells the index: the blocks are then found at
(node, "hbm") like any tier's, and readers on other nodes read them straight from the engine's pages.

Named like a tier actor (`kvcluster/<node>/hbm`): one lending engine per node. It starts by telling the index
that the node's hbm holds nothing (an earlier engine's reports are stale), and is owned by the engine's
process: it goes with it. Until the index learns that, readers find the agent gone: misses, never wrong KV.
"""

from __future__ import annotations

import ray

from kvcluster.storage import LentDirectory

from .index_client import IndexClient
from .index_reporter import IndexReporter
from .peer_server import PeerServer

LENT_TIER = "hbm"  # the tier an engine's lent paged KV is indexed as


def lent_tier(worker: str = "") -> str:
    """The index tier of one engine worker's lent pages: "hbm", or "hbm/tp0-of-2" for a tensor-parallel worker
    (`worker`). Each worker lends its own shards through an actor of its own, which clears the index's entries
    of its tier when it starts and retires: one tier name per worker keeps a worker from clearing another's."""
    return LENT_TIER + worker


def is_lent(tier: str) -> bool:
    return tier == LENT_TIER or tier.startswith(LENT_TIER + "/")


@ray.remote(num_cpus=0, max_restarts=0)
class LentPagesActor(PeerServer):
    def __init__(self, node: str, metadata: bytes, descs: bytes, slot_bytes: int, agent_name: str,
                 tier: str = LENT_TIER) -> None:
        self.node, self.tier = node, tier
        self.directory = LentDirectory(metadata, descs, slot_bytes, agent_name)
        self.reporter = IndexReporter(IndexClient.connect(), node, tier)
        self.reporter.lost()

    def _lend(self) -> LentDirectory:
        return self.directory

    def update(self, entered: list[tuple[bytes, int, int, int]], left: list[bytes]) -> None:
        """One engine step's changes: `left` keys' pages were rewritten, `entered` (key, block id, length,
        digest) are in the engine's pages now."""
        came, gone = self.directory.update(entered, left)
        self.reporter.removed(gone)
        self.reporter.stored(came)

    def retire(self) -> int:
        """The engine is shutting down: nothing is readable from it any more, and the index knows it when this
        returns. Returns the blocks it lent."""
        keys = self.directory.keys()
        self.directory.release(keys)
        ray.get(self.reporter.index.lost(self.node, self.tier))
        return len(keys)

    def describe(self) -> dict:
        return {"node": self.node, "tier": self.tier, "lent_blocks": len(self.directory),
                "slot_bytes": self.directory.slot_bytes}
