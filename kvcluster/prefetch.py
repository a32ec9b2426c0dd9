"""Queue-lookahead prefetcher: promote blocks of requests that have arrived but not run.

A real server queues requests before their prefill starts; the trace's arrival
times stand in for that queue. When a request is about to run, blocks of requests
arriving within `lead_s` after it that sit in a lower tier are promoted to tier 0
ahead of time, turning slow-tier hits into HBM hits. Counted: issued, hits (used
from tier 0 by the request they were fetched for) and wasted (evicted first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Iterable, Sequence

from .hierarchy import Hierarchy, ServeResult
from .policies.base import RequestContext


@dataclass
class PrefetchStats:
    issued: int = 0
    hits: int = 0
    wasted: int = 0


@dataclass
class Prefetcher:
    lead_s: float
    stats: PrefetchStats = field(default_factory=PrefetchStats)
    _pending: set[int] = field(default_factory=set)

    def prefetch(self, hierarchy: Hierarchy, blocks: Sequence[int], ctx: RequestContext,
                 pinned: Container[int] = ()) -> ServeResult | None:
        """Promote the lower-tier part of the prefix run of an upcoming request; None when all of it is in
        tier 0 already (nothing moves)."""
        tiers = hierarchy.prefix_tiers(blocks)
        wanted = [blocks[j] for j, tier in enumerate(tiers) if tier > 0]
        if not wanted:
            return None
        result = hierarchy.promote(wanted, ctx, pinned)
        self.stats.issued += len(result.promoted)
        self._pending.update(b for b, _ in result.promoted)
        self.after(result)
        return result

    def after(self, result: ServeResult) -> None:
        """What left tier 0 in a serve or a promotion: a prefetched block among them was wasted."""
        self.evicted([b for b, src, _ in result.demoted if src == 0] + list(result.dropped))

    def served(self, blocks: Sequence[int], hit_tier: Sequence[int]) -> None:
        """A request ran: its prefetched blocks found in tier 0 are hits."""
        pending = self._pending
        if not pending:
            return
        for block, tier in zip(blocks, hit_tier):
            if block in pending:
                pending.discard(block)
                if tier == 0:
                    self.stats.hits += 1

    def forget(self, blocks: Iterable[int]) -> None:
        """Blocks no tier holds any more, whose ids go to other blocks: none of them is pending now."""
        if self._pending:
            self._pending.difference_update(blocks)

    def evicted(self, blocks: Sequence[int]) -> None:
        """Blocks left tier 0: a prefetched one that was never used is wasted."""
        pending = self._pending
        if not pending:
            return
        for block in blocks:
            if block in pending:
                pending.discard(block)
                self.stats.wasted += 1
