"""What a tier holds, told to the index shards: the one place a tier's stored/removed/lost reports are sent from.

Every report is one fire-and-forget batched call, so a put or a read never waits on
the index; an empty batch sends nothing. The index is a hint for routing and a
replica's reads, never the truth about bytes: a report that is lost costs a miss
later, not wrong data.
"""

from __future__ import annotations

LISTING_BATCH = 4096  # keys per report when a tier lists what it already holds at start


class IndexReporter:
    """Reports of one tier (`node`, `tier`) to the index: `index` is an `IndexClient` (or anything with its
    fire-and-forget `stored`/`removed`/`lost`)."""

    def __init__(self, index, node: str, tier: str) -> None:
        self.index, self.node, self.tier = index, node, tier

    def stored(self, keys: list[bytes], pairs: list[int] | None = None) -> None:
        """`keys` are readable here now; `pairs`: their (block type, transition) pair indices, if known."""
        if keys:
            self.index.stored(self.node, self.tier, keys, pairs)

    def removed(self, keys: list[bytes]) -> None:
        """`keys` are not here (deleted, never arrived, or found missing or corrupt on a read)."""
        if keys:
            self.index.removed(self.node, self.tier, keys)

    def lost(self) -> None:
        """This tier came back empty (a fresh process): whatever the index thought it held is gone."""
        self.index.lost(self.node, self.tier)

    def listed(self, keys: list[bytes]) -> None:
        """What a durable tier already holds when it starts, in batches of LISTING_BATCH keys."""
        for i in range(0, len(keys), LISTING_BATCH):
            self.stored(keys[i : i + LISTING_BATCH])
