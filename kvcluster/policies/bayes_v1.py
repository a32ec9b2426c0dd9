"""`bayes-v1`: evict the block with the least expected value of keeping it.

Value of a block = P(reuse) x head importance x refetch cost / bytes. P(reuse)
comes from the reuse predictor: the Beta posterior of the block's (type,
transition) pair, sharpened by the block's own reuse record. Values enter a
GreedyDual clock (priority = L + value, L = priority of the last victim), so a
block that stops being used ages out however valuable its class.

Prefix semantics: within a request, priorities are raised from the tail
backwards (a block never ranks below a block that extends it), so a prefix is
never evicted before its own suffix and no orphaned suffix wastes capacity.

Head granularity: with `heads > 1` the ids are head shards (block * heads + h,
consecutive per block). A shard's value is its block's value times the EMA
importance of head h, so the least important heads of a block leave first;
every shard of a block still outranks every shard of the block after it.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

from ..block_types import TransitionType
from ..predictor import ReusePredictor
from .base import EvictionPolicy, RequestContext
from .registry import register

_NT = len(TransitionType)


@register
class BayesV1Policy(EvictionPolicy):
    """GreedyDual eviction valued by the Bayesian reuse predictor (the first `bayes`, kept as a baseline)."""

    name = "bayes-v1"

    def __init__(
        self,
        capacity: int,
        predictor: ReusePredictor | None = None,
        refetch_cost: Callable[[int], float] | None = None,
        head_importance: Sequence[float] | None = None,
        block_bytes: int = 1,
        heads: int = 1,
    ) -> None:
        super().__init__(capacity)
        if heads < 1 or (head_importance is not None and len(head_importance) != heads):
            raise ValueError("need heads >= 1 and one importance per head")
        self.predictor = predictor or ReusePredictor()
        self.refetch_cost = refetch_cost  # block position -> relative cost to bring it back
        self.heads = heads
        self.head_importance = tuple(head_importance or (1.0,) * heads)  # EMA scores, see HeadImportance
        self.block_bytes = block_bytes
        self._prio: dict[int, float] = {}  # resident block -> current priority
        self._heap: list[tuple[float, int, int]] = []  # (priority, tiebreak, block), lazy deletion
        self._clock = 0.0
        self._tick = 0

    def __contains__(self, block: int) -> bool:
        return block in self._prio

    def __len__(self) -> int:
        return len(self._prio)

    def resident(self):
        return self._prio.keys()

    def remembers(self, block: int) -> bool:
        return block in self._prio or self.predictor.watching(block)

    def prefix_hits(self, blocks: Sequence[int]) -> int:
        prio, n = self._prio, 0
        for block in blocks:
            if block not in prio:
                return n
            n += 1
        return n

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        pairs = self._pairs(blocks, ctx)
        return self._place(blocks, self._values(blocks, self.predictor.observe_many(blocks, pairs, ctx.now)))

    def admit(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        """Demoted blocks keep the value the predictor gives them, without a new use.

        Their pair is the one they were last used under (ctx describes another request).
        """
        pair_of, p_block = self.predictor.pair_of, self.predictor.p_block
        fallback = 1 * _NT + ctx.transition
        new = [b for b in blocks if b not in self._prio]
        return self._place(new, self._values(new, [p_block(b, pair_of(b, fallback)) for b in new]))

    def value(self, block: int, pair: int, position: int) -> float:
        """Expected value per byte of keeping `block` resident."""
        return self._values([block], [self.predictor.p_block(block, pair)], offset=position)[0]

    def _pairs(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        base = ctx.transition
        types = ctx.block_types
        if not types:
            return [1 * _NT + base] * len(blocks)  # untyped traces: history
        return [t * _NT + base for t in types]

    def _values(self, blocks: Sequence[int], probs: list[float], offset: int = 0) -> list[float]:
        scale = 1.0 / self.block_bytes
        if self.heads > 1:
            imp, heads = self.head_importance, self.heads
            probs = [p * imp[b % heads] for p, b in zip(probs, blocks)]
        if self.refetch_cost is not None:
            cost, heads = self.refetch_cost, self.heads
            return [p * cost((offset + j) // heads) * scale for j, p in enumerate(probs)]
        return [p * scale for p in probs] if scale != 1.0 else probs

    def _place(self, blocks: Sequence[int], values: list[float]) -> list[int]:
        """Set priorities tail-first (prefix >= suffix), then evict down to capacity."""
        prio, heap, clock, heads = self._prio, self._heap, self._clock, self.heads
        push, tick = heapq.heappush, self._tick
        floor = block_max = 0.0  # floor: the highest priority among the blocks after this one
        for j in range(len(blocks) - 1, -1, -1):
            block = blocks[j]
            target = clock + values[j]
            if target <= floor:  # strictly above what extends it, so ties never break prefixes
                target = floor + 1e-9
            if target > block_max:
                block_max = target
            old = prio.get(block)
            if old is None:
                prio[block] = target
                tick += 1
                push(heap, (target, tick, block))
            elif old < target:
                prio[block] = target  # its heap entry is now stale-low; re-pushed when it surfaces
            if heads == 1 or block % heads == 0:  # first shard of a block: the block is done
                floor, block_max = max(floor, block_max), 0.0
        self._tick = tick
        evicted = self._evict_over_capacity()
        if len(heap) > 4 * len(prio) + 1024:
            self._compact()
        return evicted

    def _evict_over_capacity(self) -> list[int]:
        prio, heap, pop = self._prio, self._heap, heapq.heappop
        evicted = []
        while len(prio) > self.capacity:
            p, _, block = pop(heap)
            current = prio.get(block)
            if current is None:
                continue  # discarded earlier
            if current > p:  # refreshed since pushed: re-queue at its real priority
                self._tick += 1
                heapq.heappush(heap, (current, self._tick, block))
                continue
            del prio[block]
            self._clock = p
            evicted.append(block)
        return evicted

    def discard(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._prio.pop(block, None)

    def _compact(self) -> None:
        self._heap = [(p, i, b) for i, (b, p) in enumerate(self._prio.items())]
        heapq.heapify(self._heap)
        self._tick = len(self._heap)

    def check_integrity(self) -> None:
        assert len(self._prio) <= self.capacity, (len(self._prio), self.capacity)
        lowest: dict[int, float] = {}
        for p, _, b in self._heap:
            lowest[b] = min(p, lowest.get(b, p))
        assert all(b in lowest and lowest[b] <= p for b, p in self._prio.items()), "each resident block is queued"
        self.predictor.check_integrity()
