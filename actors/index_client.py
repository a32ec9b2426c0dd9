"""How every process talks to the sharded block index: remote (`IndexClient`) or a local copy (`LocalIndex`).

A report or a lookup is one batched call per shard owning any of its keys (keys
go to shards by `shard_of`), issued together; with one shard it is exactly one
call, as before sharding. `LocalIndex` answers lookups from a copy in this
process, refreshed in the background from the shards' journals: no remote call
per request, at the price of seeing changes up to one refresh late.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from typing import Sequence

import ray

from kvcluster.block_index import PrefixMatch, merge_prefix, prefix_runs, split_by_shard
from kvcluster.index_journal import IndexFollower

from .index_actor import INDEX_NAME, NAMESPACE, shard_name

log = logging.getLogger(__name__)


class IndexClient:
    """Handles of every shard, shard 0 first. Writes are fire-and-forget; reads wait for every shard asked."""

    def __init__(self, handles: Sequence) -> None:
        self.handles = list(handles)
        self.shards = len(self.handles)

    @classmethod
    def connect(cls, namespace: str = NAMESPACE, timeout_s: float = 60.0) -> "IndexClient":
        """The running index, found by name (shard 0 says how many shards there are)."""
        first = ray.get_actor(INDEX_NAME, namespace=namespace)
        shards = ray.get(first.shard_count.remote(), timeout=timeout_s)
        return cls([first] + [ray.get_actor(shard_name(i), namespace=namespace) for i in range(1, shards)])

    def stored(self, node: str, tier: str, keys: list[bytes], pairs: list[int] | None = None) -> None:
        if self.shards == 1:
            self.handles[0].stored.remote(node, tier, keys, pairs)
            return
        for shard, (positions, owned) in split_by_shard(keys, self.shards).items():
            self.handles[shard].stored.remote(node, tier, owned, None if pairs is None else
                                              [pairs[p] for p in positions])

    def removed(self, node: str, tier: str, keys: list[bytes]) -> None:
        if self.shards == 1:
            self.handles[0].removed.remote(node, tier, keys)
            return
        for shard, (_, owned) in split_by_shard(keys, self.shards).items():
            self.handles[shard].removed.remote(node, tier, owned)

    def lost(self, node: str, tier: str | None = None) -> list:
        """Every shard forgets what `node` (its `tier`, or all of it) held; the refs say when they have."""
        return [h.lost.remote(node, tier) for h in self.handles]

    def _asked(self, keys: Sequence[bytes]) -> tuple[list[list[int]], list]:
        parts = split_by_shard(keys, self.shards)
        return ([positions for positions, _ in parts.values()],
                [self.handles[shard].locate.remote(owned) for shard, (_, owned) in parts.items()])

    def longest_prefix(self, keys: Sequence[bytes], timeout_s: float | None = None) -> PrefixMatch:
        if self.shards == 1:
            return ray.get(self.handles[0].longest_prefix.remote(list(keys)), timeout=timeout_s)
        positions, refs = self._asked(keys)
        return merge_prefix(len(keys), zip(positions, ray.get(refs, timeout=timeout_s)))

    def held_runs(self, chains: Sequence[Sequence[bytes]], timeout_s: float | None = None) -> list[int]:
        """For each chain of keys, how many of its leading blocks the cluster holds: all chains in one `locate`
        per shard (tensor-parallel workers' shards of one prefix are asked together)."""
        flat = [k for chain in chains for k in chain]
        if not flat:
            return [0] * len(chains)
        positions, refs = self._asked(flat)
        return prefix_runs([len(c) for c in chains], zip(positions, ray.get(refs, timeout=timeout_s)))

    async def longest_prefix_async(self, keys: Sequence[bytes]) -> PrefixMatch:
        if self.shards == 1:
            return await self.handles[0].longest_prefix.remote(list(keys))
        positions, refs = self._asked(keys)
        return merge_prefix(len(keys), zip(positions, await asyncio.gather(*refs)))

    def occupancy(self, timeout_s: float | None = None) -> dict:
        total: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for part in ray.get([h.occupancy.remote() for h in self.handles], timeout=timeout_s):
            for node, tiers in part.items():
                for tier, count in tiers.items():
                    total[node][tier] += count
        return {node: dict(tiers) for node, tiers in total.items()}


class LocalIndex:
    """A read-only copy of the index in this process; a thread refreshes it every `refresh_s` seconds with one
    call per shard. Lookups cost no remote call; a shard that does not answer leaves its copy as it was."""

    def __init__(self, client: IndexClient, refresh_s: float, timeout_s: float = 10.0) -> None:
        self.client, self.refresh_s, self.timeout_s = client, refresh_s, timeout_s
        self.shards = client.shards
        self.follower = IndexFollower(client.shards)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._follow, name="kvcluster-index-follower", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        refs = [h.changes_since.remote(*self.follower.positions[s]) for s, h in enumerate(self.client.handles)]
        for shard, ref in enumerate(refs):
            try:
                changes = ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("index shard %d unavailable (%s): its local copy is not refreshed", shard,
                            type(exc).__name__)
                continue
            with self._lock:
                self.follower.apply(shard, changes)

    def _follow(self) -> None:
        while not self._stop.wait(self.refresh_s):
            if not ray.is_initialized():  # the process left Ray: a call now would start a new local Ray
                return
            self.refresh()

    def longest_prefix(self, keys: Sequence[bytes], timeout_s: float | None = None) -> PrefixMatch:
        with self._lock:
            return self.follower.longest_prefix(keys)

    async def longest_prefix_async(self, keys: Sequence[bytes]) -> PrefixMatch:
        return self.longest_prefix(keys)

    def close(self) -> None:
        self._stop.set()


def open_index(refresh_s: float | None = None) -> IndexClient | LocalIndex:
    """The running index as this process should see it: a local copy refreshed every `refresh_s` seconds, or
    (None) remote lookups."""
    client = IndexClient.connect()
    return client if refresh_s is None else LocalIndex(client, refresh_s)
