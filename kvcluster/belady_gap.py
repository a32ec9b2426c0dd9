"""A live estimate of how far a tier's policy is from Belady's optimum.

Belady needs the future, so it cannot run live; but over a window of recent
requests the "future" of every access but the last is known. The estimator keeps
the last `window` requests' block keys of one tier and replays them offline
through the same simulator the trace replays use: once with the tier's own
policy, once with Belady, at the tier's capacity. The difference in hit rate is
the gap the policy leaves on this traffic. Pure: no Ray, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from .block_types import BlockType, TransitionType
from .keys import BlockKey
from .hierarchy import TierPlan
from .simulator import prepare, replay
from .traces.base import Trace, TraceRequest


@dataclass(frozen=True)
class GapEstimate:
    requests: int
    policy_hit_rate: float
    belady_hit_rate: float

    @property
    def gap(self) -> float:
        return self.belady_hit_rate - self.policy_hit_rate


class BeladyGapEstimator:
    def __init__(self, capacity_blocks: int, policy: str = "lru", window: int = 2000, block_size: int = 16) -> None:
        self.capacity_blocks, self.policy, self.block_size = capacity_blocks, policy, block_size
        self._recent: deque[tuple[BlockKey, ...]] = deque(maxlen=window)

    def record(self, keys: Sequence[BlockKey]) -> None:
        """One request's prefix block keys, in order."""
        if keys:
            self._recent.append(tuple(keys))

    def estimate(self) -> GapEstimate | None:
        if len(self._recent) < 2:
            return None
        requests = tuple(TraceRequest(float(i), "", keys, (BlockType.HISTORY,) * len(keys), TransitionType.FIRST,
                                      len(keys) * self.block_size, 0) for i, keys in enumerate(self._recent))
        prepared = prepare(Trace("live", "live", self.block_size, requests))
        plan = [TierPlan("tier", self.capacity_blocks)]
        own = replay(prepared, self.policy, plan).hit_rate
        best = replay(prepared, "belady", plan).hit_rate
        return GapEstimate(len(requests), own, best)
