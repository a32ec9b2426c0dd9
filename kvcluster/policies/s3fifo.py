"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO.

New blocks enter the small queue (10% of capacity); those used again before they
reach its head move to main, the rest leave and are remembered in the ghost
queue, from which a returning block goes straight to main. Main reinserts a
block while its frequency (capped at 3) is above zero, decrementing it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .base import EvictionPolicy, RequestContext
from .registry import register


@register
class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        super().__init__(capacity)
        self.small_cap = max(1, int(capacity * small_fraction)) if capacity else 0
        self.small: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}

    def __contains__(self, block: int) -> bool:
        return block in self.freq

    def __len__(self) -> int:
        return len(self.freq)

    def remembers(self, block: int) -> bool:
        return block in self.freq or block in self.ghost

    def resident(self):
        return self.freq.keys()

    def _insert(self, block: int, evicted: list[int]) -> None:
        if self.capacity == 0:
            evicted.append(block)
            return
        while len(self.freq) >= self.capacity:
            self._evict(evicted)
        if block in self.ghost:
            del self.ghost[block]
            self.main[block] = None
        else:
            self.small[block] = None
        self.freq[block] = 0

    def _evict(self, evicted: list[int]) -> None:
        if len(self.small) >= self.small_cap or not self.main:
            self._evict_small(evicted)
        else:
            self._evict_main(evicted)

    def _evict_small(self, evicted: list[int]) -> None:
        while self.small:
            block, _ = self.small.popitem(last=False)
            if self.freq[block] > 0:
                self.freq[block] = 0
                self.main[block] = None
                if len(self.main) > self.capacity - self.small_cap and len(self.main) > 1:
                    self._evict_main(evicted)
                    return
            else:
                del self.freq[block]
                self.ghost[block] = None
                if len(self.ghost) > max(1, self.capacity - self.small_cap):
                    self.ghost.popitem(last=False)
                evicted.append(block)
                return

    def _evict_main(self, evicted: list[int]) -> None:
        while self.main:
            block, _ = self.main.popitem(last=False)
            if self.freq[block] > 0:
                self.freq[block] -= 1
                self.main[block] = None
            else:
                del self.freq[block]
                evicted.append(block)
                return

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        evicted: list[int] = []
        freq = self.freq
        for block in blocks:
            f = freq.get(block)
            if f is not None:
                if f < 3:
                    freq[block] = f + 1
            else:
                self._insert(block, evicted)
        return [b for b in evicted if b not in self] if evicted else evicted

    def admit(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        """Demoted blocks enter like new ones (small queue, or main if in the ghost)."""
        evicted: list[int] = []
        for block in blocks:
            if block not in self.freq:
                self._insert(block, evicted)
        return [b for b in evicted if b not in self] if evicted else evicted

    def discard(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self.freq.pop(block, None) is not None:
                self.small.pop(block, None)
                self.main.pop(block, None)

    def check_integrity(self) -> None:
        assert len(self.freq) <= self.capacity
        assert len(self.small) + len(self.main) == len(self.freq)
        assert not (set(self.small) & set(self.main))
        assert all(0 <= f <= 3 for f in self.freq.values())
