"""An index shard's changes in order, and a read-only copy that follows them.

A replica that looks up every request's prefix in the global index pays a remote
call per request. A `IndexFollower` keeps a copy of the shards in the replica's
process instead, fed by each shard's `IndexJournal`: one call per shard per
refresh returns every change since the follower's cursor (or, when the follower
fell further behind than the journal keeps, or the shard restarted, a snapshot).

The copy is a hint, like the index itself: a block it still lists after its
tier dropped it is read, found missing and counted a miss; a block stored since
the last refresh is not found and is recomputed. Neither gives wrong output.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from .block_index import BlockIndex, PrefixMatch, merge_prefix, split_by_shard
from .keys import BlockKey

Change = tuple[str, str, str, list[BlockKey]]  # (stored | removed | lost, node, tier, keys); lost: tier "" = all


@dataclass(frozen=True)
class Changes:
    """What a follower at (`epoch`, cursor) is missing: `changes` in order, or a whole `snapshot` (listing)."""
    epoch: str
    cursor: int
    changes: tuple[Change, ...] = ()
    snapshot: tuple[tuple[str, str, list[BlockKey]], ...] | None = None


class IndexJournal:
    """The last `capacity_keys` keys' worth of one shard's changes, numbered."""

    def __init__(self, index: BlockIndex, capacity_keys: int = 1 << 20) -> None:
        self.index = index
        self.capacity_keys = capacity_keys
        self.epoch = uuid.uuid4().hex  # a restarted shard starts a new numbering: followers take a snapshot
        self.cursor = 0  # changes recorded so far
        self._kept: deque[Change] = deque()
        self._kept_keys = 0

    def record(self, op: str, node: str, tier: str, keys: list[BlockKey]) -> None:
        self._kept.append((op, node, tier, keys))
        self._kept_keys += max(1, len(keys))
        self.cursor += 1
        while self._kept_keys > self.capacity_keys and len(self._kept) > 1:
            self._kept_keys -= max(1, len(self._kept.popleft()[3]))

    def since(self, epoch: str | None, cursor: int) -> Changes:
        oldest = self.cursor - len(self._kept)
        if epoch != self.epoch or not oldest <= cursor <= self.cursor:
            return Changes(self.epoch, self.cursor, snapshot=tuple(self.index.listing()))
        skip = cursor - oldest
        return Changes(self.epoch, self.cursor, tuple(self._kept[i] for i in range(skip, len(self._kept))))


class IndexFollower:
    """A read-only copy of `shards` index shards, brought up to date by `apply` (one `Changes` per shard)."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.copies = [BlockIndex() for _ in range(shards)]
        self.positions: list[tuple[str | None, int]] = [(None, 0)] * shards  # (epoch, cursor) per shard

    def apply(self, shard: int, changes: Changes) -> None:
        copy = self.copies[shard]
        if changes.snapshot is not None:
            copy = self.copies[shard] = BlockIndex()
            for node, tier, keys in changes.snapshot:
                copy.stored(node, tier, keys)
        for op, node, tier, keys in changes.changes:
            if op == "stored":
                copy.stored(node, tier, keys)
            elif op == "removed":
                copy.removed(node, tier, keys)
            else:
                copy.lost(node, tier or None)
        self.positions[shard] = (changes.epoch, changes.cursor)

    def longest_prefix(self, keys: Sequence[BlockKey]) -> PrefixMatch:
        if self.shards == 1:
            return self.copies[0].longest_prefix(keys)
        return merge_prefix(len(keys), ((pos, self.copies[s].locate(owned))
                                        for s, (pos, owned) in split_by_shard(keys, self.shards).items()))

