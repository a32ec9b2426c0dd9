"""The global block index as a named Ray actor (one per cluster)."""

from __future__ import annotations

import ray

from kvcluster.block_index import BlockIndex, PrefixMatch

NAMESPACE = "kvcluster"
INDEX_NAME = "kvcluster/index"


@ray.remote(num_cpus=0, max_restarts=-1)
class IndexActor:
    """Contains one BlockIndex; every method takes a whole batch of keys."""

    def __init__(self) -> None:
        self.index = BlockIndex()

    def stored(self, node: str, tier: str, keys: list[bytes], pairs: list[int] | None = None) -> None:
        self.index.stored(node, tier, keys, pairs)

    def removed(self, node: str, tier: str, keys: list[bytes]) -> None:
        self.index.removed(node, tier, keys)

    def lost(self, node: str, tier: str | None = None) -> int:
        return self.index.lost(node, tier)

    def longest_prefix(self, keys: list[bytes]) -> PrefixMatch:
        return self.index.longest_prefix(keys)

    def occupancy(self) -> dict:
        return self.index.occupancy()
