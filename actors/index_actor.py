"""The global block index as named Ray actors: one per shard of the key space.

Shard 0 keeps the plain name `kvcluster/index` and says how many shards there are,
so a caller needs only that name (`kvcluster.actors.index_client`).
"""

from __future__ import annotations

import ray

from kvcluster.block_index import BlockIndex, PrefixMatch
from kvcluster.index_journal import Changes, IndexJournal

NAMESPACE = "kvcluster"
INDEX_NAME = "kvcluster/index"


def shard_name(shard: int) -> str:
    return INDEX_NAME if shard == 0 else f"{INDEX_NAME}/{shard}"


@ray.remote(num_cpus=0, max_restarts=-1)
class IndexActor:
    """One BlockIndex (the keys whose `shard_of` is `shard`) and its journal; every method takes a batch."""

    def __init__(self, shard: int = 0, shards: int = 1) -> None:
        self.shard, self.shards = shard, shards
        self.index = BlockIndex()
        self.journal = IndexJournal(self.index)

    def shard_count(self) -> int:
        return self.shards

    def stored(self, node: str, tier: str, keys: list[bytes], pairs: list[int] | None = None) -> None:
        self.index.stored(node, tier, keys, pairs)
        self.journal.record("stored", node, tier, keys)

    def removed(self, node: str, tier: str, keys: list[bytes]) -> None:
        self.index.removed(node, tier, keys)
        self.journal.record("removed", node, tier, keys)

    def lost(self, node: str, tier: str | None = None) -> int:
        self.journal.record("lost", node, tier or "", [])
        return self.index.lost(node, tier)

    def longest_prefix(self, keys: list[bytes]) -> PrefixMatch:
        return self.index.longest_prefix(keys)

    def locate(self, keys: list[bytes]) -> list:
        return self.index.locate(keys)

    def changes_since(self, epoch: str | None, cursor: int) -> Changes:
        return self.journal.since(epoch, cursor)

    def occupancy(self) -> dict:
        return self.index.occupancy()
