"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03), block by block in request order.

T1 holds blocks seen once recently, T2 blocks seen at least twice; ghost lists
B1/B2 remember recent victims of each and steer the target size p of T1.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .base import EvictionPolicy, RequestContext
from .registry import register


@register
class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.t1 or block in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def resident(self):
        return list(self.t1) + list(self.t2)

    def remembers(self, block: int) -> bool:
        return block in self.t1 or block in self.t2 or block in self.b1 or block in self.b2

    def _replace(self, in_b2: bool, evicted: list[int]) -> None:
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            victim, _ = self.t1.popitem(last=False)
            self.b1[victim] = None
        elif self.t2:
            victim, _ = self.t2.popitem(last=False)
            self.b2[victim] = None
        else:
            victim, _ = self.t1.popitem(last=False)
            self.b1[victim] = None
        evicted.append(victim)

    def _miss(self, block: int, evicted: list[int], adapt: bool) -> None:
        c = self.capacity
        if block in self.b1:
            if adapt:
                self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            del self.b1[block]
            if len(self) >= c:
                self._replace(False, evicted)
            self.t2[block] = None
            return
        if block in self.b2:
            if adapt:
                self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            del self.b2[block]
            if len(self) >= c:
                self._replace(True, evicted)
            self.t2[block] = None
            return
        if len(self.t1) + len(self.b1) >= c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                if len(self) >= c:
                    self._replace(False, evicted)
            else:
                victim, _ = self.t1.popitem(last=False)
                evicted.append(victim)
        elif len(self) + len(self.b1) + len(self.b2) >= c:
            if len(self) + len(self.b1) + len(self.b2) >= 2 * c and self.b2:
                self.b2.popitem(last=False)
            if len(self) >= c:
                self._replace(False, evicted)
        self.t1[block] = None

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        evicted: list[int] = []
        if self.capacity == 0:
            return [b for b in blocks]
        for block in blocks:
            if block in self.t1:
                del self.t1[block]
                self.t2[block] = None
            elif block in self.t2:
                self.t2.move_to_end(block)
            else:
                self._miss(block, evicted, adapt=True)
        return [b for b in evicted if b not in self] if evicted else evicted

    def admit(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        """Demoted blocks take the miss path without moving p (no evidence of a use)."""
        if self.capacity == 0:
            return list(blocks)
        evicted: list[int] = []
        for block in blocks:
            if block not in self:
                self._miss(block, evicted, adapt=False)
        return [b for b in evicted if b not in self] if evicted else evicted

    def discard(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.t1.pop(block, None)
            self.t2.pop(block, None)

    def check_integrity(self) -> None:
        c = self.capacity
        assert len(self) <= c
        assert len(self.t1) + len(self.b1) <= c or c == 0
        assert len(self) + len(self.b1) + len(self.b2) <= 2 * c
        assert 0 <= self.p <= c
        assert not (set(self.t1) & set(self.t2)) and not (set(self.b1) & set(self.b2))
