"""Least frequently used, ties broken by least recently used; O(1) frequency buckets."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .base import EvictionPolicy, RequestContext
from .registry import register


@register
class LFUPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._freq: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._min = 0

    def __contains__(self, block: int) -> bool:
        return block in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def resident(self):
        return self._freq.keys()

    def _bump(self, block: int) -> None:
        f = self._freq[block]
        bucket = self._buckets[f]
        del bucket[block]
        if not bucket:
            del self._buckets[f]
            if self._min == f:
                self._min = f + 1
        self._freq[block] = f + 1
        self._buckets.setdefault(f + 1, OrderedDict())[block] = None

    def _insert(self, block: int) -> list[int]:
        evicted = []
        if self.capacity == 0:
            return [block]
        if len(self._freq) >= self.capacity:
            evicted.append(self._evict())
        self._freq[block] = 1
        self._buckets.setdefault(1, OrderedDict())[block] = None
        self._min = 1
        return [b for b in evicted if b not in self] if evicted else evicted

    def _evict(self) -> int:
        bucket = self._buckets[self._min]
        block, _ = bucket.popitem(last=False)
        if not bucket:
            del self._buckets[self._min]
            self._min = min(self._buckets) if self._buckets else 0
        del self._freq[block]
        return block

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        evicted: list[int] = []
        for block in blocks:
            if block in self._freq:
                self._bump(block)
            else:
                evicted += self._insert(block)
        return [b for b in evicted if b not in self] if evicted else evicted

    def admit(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        """Demoted blocks start at frequency 1, like any insert."""
        evicted: list[int] = []
        for block in blocks:
            if block not in self._freq:
                evicted += self._insert(block)
        return [b for b in evicted if b not in self] if evicted else evicted

    def discard(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            f = self._freq.pop(block, None)
            if f is None:
                continue
            bucket = self._buckets[f]
            del bucket[block]
            if not bucket:
                del self._buckets[f]
                if self._min == f:
                    self._min = min(self._buckets) if self._buckets else 0

    def check_integrity(self) -> None:
        assert len(self._freq) <= self.capacity
        assert sum(len(b) for b in self._buckets.values()) == len(self._freq)
        for f, bucket in self._buckets.items():
            assert bucket and all(self._freq[b] == f for b in bucket)
        assert not self._buckets or self._min == min(self._buckets)
