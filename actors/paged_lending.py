"""The engine's side of lending its paged KV as its node's hbm tier (`kvcluster.integrations.vllm.lending`).

`PagedKVLending.start` registers the pages with a NIXL agent of the engine's process and starts the node's
`LentPagesActor`; each step the connector tells it which blocks entered and left the pages (`flush`, one
fire-and-forget call). The cluster store's `lend` starts it (`serve_apps/cluster_store.py`).
"""

from __future__ import annotations

import logging
from typing import Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvcluster.integrations.vllm.lending import LentBlocks, page_digests
from kvcluster.integrations.vllm.paged_kv import PagedKV
from kvcluster.keys import BlockKey
from kvcluster.storage import NixlRegionLender, StorageError

from .index_actor import NAMESPACE
from .lent_pages_actor import LentPagesActor, lent_tier
from .tier_actor import actor_name

log = logging.getLogger(__name__)


class PagedKVLending:
    """This engine's side of lending: its NIXL agent over the paged KV, the blocks lent, the control actor."""

    def __init__(self, paged: PagedKV, node: str, actor, lender: NixlRegionLender) -> None:
        self.paged, self.node, self.actor, self.lender = paged, node, actor, lender
        self.blocks = LentBlocks()
        self.updates = 0  # calls to the actor (one per step with changes)

    @classmethod
    def start(cls, paged: PagedKV, node: str, suffix: str = "") -> "PagedKVLending | None":
        """Lend `paged` as node `node`'s hbm tier (`suffix`: a tensor-parallel worker's part of its actor's name),
        or None (logged) when it cannot: another engine on the node lends already, or NIXL cannot register the
        memory."""
        tier = lent_tier(suffix)
        name = actor_name(node, tier)
        try:
            ray.get_actor(name, namespace=NAMESPACE)
            log.warning("kvcluster: another engine lends node %s's paged KV already; this one lends nothing", node)
            return None
        except ValueError:
            pass
        try:
            lender = NixlRegionLender(paged.regions, name=f"kvc-lend-{node}{suffix.replace('/', '-')}-{id(paged):x}")
        except (StorageError, RuntimeError) as exc:  # NIXL missing, or it cannot register this memory
            log.warning("kvcluster: the paged KV cannot be lent over NIXL (%s); it is not lent", exc)
            return None
        here = NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=True)
        try:
            # Not waited for: the engine goes on while the actor starts (seconds on a busy node; a deadline here
            # left whole workers unlent), and the steps' updates queue at the actor until it runs. One that never
            # starts leaves its blocks unlent: misses elsewhere, never wrong bytes.
            actor = LentPagesActor.options(name=name, namespace=NAMESPACE, scheduling_strategy=here).remote(
                node, lender.metadata, lender.descs, paged.row_bytes, lender.name, tier)
        except (ValueError, ray.exceptions.RayError) as exc:  # the name was taken meanwhile
            log.warning("kvcluster: the lent-pages actor of node %s was not created (%s); nothing is lent", node, exc)
            lender.close()
            return None
        return cls(paged, node, actor, lender)

    def written(self, block_ids: Sequence[int]) -> None:
        self.blocks.written(block_ids)

    def lend(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        """These blocks' pages hold these keys, complete: lend them, with the digest of their pages."""
        new = [(key, b) for key, b in zip(keys, block_ids) if self.blocks.block_of(key) != b]
        digests = page_digests([self.paged.block_pages(b) for _, b in new])
        for (key, b), digest in zip(new, digests):
            self.blocks.lend(key, b, self.paged.row_bytes, digest)

    def flush(self) -> None:
        """The step's changes to the actor, in one fire-and-forget call (none when nothing changed)."""
        entered, left = self.blocks.drain()
        if entered or left:
            self.actor.update.remote(entered, left)
            self.updates += 1

    def close(self, timeout_s: float) -> None:
        """Stop lending: the index forgets the blocks (waited for, bounded), then the pages are unregistered."""
        try:
            ray.get(self.actor.retire.remote(), timeout=timeout_s)
            ray.kill(self.actor)
        except ray.exceptions.RayError:
            pass  # gone already: its reports go stale and readers miss
        self.lender.close()
