"""Least recently used: the policy of vLLM's prefix cache and LMCache's offload."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .base import EvictionPolicy, RequestContext
from .registry import register


@register
class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def __len__(self) -> int:
        return len(self._order)

    def resident(self):
        return self._order.keys()

    def prefix_hits(self, blocks: Sequence[int]) -> int:
        order, n = self._order, 0
        for block in blocks:
            if block not in order:
                return n
            n += 1
        return n

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        order, cap, evicted = self._order, self.capacity, []
        move, pop = order.move_to_end, order.popitem
        for block in blocks:
            if block in order:
                move(block)
            else:
                order[block] = None
                if len(order) > cap:
                    evicted.append(pop(last=False)[0])
        return [b for b in evicted if b not in self] if evicted else evicted

    def admit(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        """Demoted blocks enter at the MRU end (they were just in use above)."""
        order, evicted = self._order, []
        for block in blocks:
            if block not in order:
                order[block] = None
                if len(order) > self.capacity:
                    evicted.append(order.popitem(last=False)[0])
        return [b for b in evicted if b not in self] if evicted else evicted

    def discard(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._order.pop(block, None)

    def check_integrity(self) -> None:
        assert len(self._order) <= self.capacity
