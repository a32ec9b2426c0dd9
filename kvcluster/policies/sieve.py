"""SIEVE (Zhang et al., NSDI '24): one FIFO queue, a visited bit and a moving hand.

New blocks enter at the head. A hit only sets the block's visited bit. To evict,
the hand walks from the tail towards the head: a visited block has its bit
cleared and stays where it is; the first unvisited block is the victim, and the
hand stays at the victim's neighbour for next time, wrapping to the tail when it
passes the head. Unlike CLOCK, survivors are not moved to the head, so new
blocks are weeded out quickly (lazy promotion, quick demotion).

Prefix caches: the blocks a request brings in enter tail first, so its first
block is the newest and a prefix never reaches the hand before its own suffix
(in request order, SIEVE would weed out the prefix first and every later hit on
that chain would be lost).

The queue is a doubly linked list in two dicts (towards head / towards tail).
"""

from __future__ import annotations

from typing import Sequence

from .base import EvictionPolicy, RequestContext
from .registry import register


@register
class SievePolicy(EvictionPolicy):
    name = "sieve"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._visited: dict[int, bool] = {}
        self._newer: dict[int, int | None] = {}  # block -> its neighbour towards the head
        self._older: dict[int, int | None] = {}  # block -> its neighbour towards the tail
        self._head: int | None = None  # newest
        self._tail: int | None = None  # oldest
        self._hand: int | None = None

    def __contains__(self, block: int) -> bool:
        return block in self._visited

    def __len__(self) -> int:
        return len(self._visited)

    def resident(self):
        return self._visited.keys()

    def _push(self, block: int) -> None:
        self._visited[block] = False
        self._newer[block] = None
        self._older[block] = self._head
        if self._head is not None:
            self._newer[self._head] = block
        self._head = block
        if self._tail is None:
            self._tail = block

    def _unlink(self, block: int) -> None:
        newer, older = self._newer.pop(block), self._older.pop(block)
        del self._visited[block]
        if newer is None:
            self._head = older
        else:
            self._older[newer] = older
        if older is None:
            self._tail = newer
        else:
            self._newer[older] = newer
        if self._hand == block:
            self._hand = newer

    def _evict_one(self) -> int:
        visited, newer = self._visited, self._newer
        hand = self._hand if self._hand is not None else self._tail
        while visited[hand]:
            visited[hand] = False
            hand = newer[hand]
            if hand is None:
                hand = self._tail
        self._hand = newer[hand]
        self._unlink(hand)
        return hand

    def _insert(self, blocks: Sequence[int], touch: bool) -> list[int]:
        evicted: list[int] = []
        visited = self._visited
        missing = []
        for block in blocks:
            if block in visited:
                if touch:
                    visited[block] = True
            else:
                missing.append(block)
        seen = set()
        for block in reversed(missing):
            if block in seen:
                continue
            seen.add(block)
            if self.capacity == 0:
                evicted.append(block)
                continue
            if len(visited) >= self.capacity:
                evicted.append(self._evict_one())
            self._push(block)
        return [b for b in evicted if b not in visited] if evicted else evicted

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        return self._insert(blocks, True)

    def admit(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        """Demoted blocks enter at the head, unvisited, like new ones."""
        return self._insert(blocks, False)

    def discard(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if block in self._visited:
                self._unlink(block)

    def order(self) -> list[int]:
        """Resident blocks from the tail (oldest) to the head (newest)."""
        out, block = [], self._tail
        while block is not None:
            out.append(block)
            block = self._newer[block]
        return out

    def check_integrity(self) -> None:
        assert len(self._visited) <= self.capacity
        chain = self.order()
        assert len(chain) == len(self._visited) == len(set(chain))
        assert self._hand is None or self._hand in self._visited
