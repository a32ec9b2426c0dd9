"""What an engine's workers hold, as vLLM's scheduler learns it from their reports.

When vLLM runs its workers in processes of their own (the "mp" executor: tensor parallelism, or vLLM's
default on CPU), each worker keeps the tiers of its own shard of the KV and the scheduler cannot ask them.
Each worker reports, with every step's output, which blocks entered or left its tiers
(`LocalBlockStore.residency_changes`); its first report lists everything it holds. A block is held when
every worker holds its shard: that is what the scheduler may promise vLLM.

The view may lag a worker by a step, and that is safe: a block a worker dropped meanwhile fails its load
and is recomputed (the connector's load errors), and one it stored meanwhile is recomputed once more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ...keys import BlockKey


@dataclass
class RankReport:
    """One worker's changes since its last report; `full` says `entered` lists everything it holds."""

    entered: list[BlockKey] = field(default_factory=list)
    left: list[BlockKey] = field(default_factory=list)
    full: bool = False


class WorkerHoldings:
    """Per block, the set of workers holding their shard of it (a bit mask)."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"an engine has at least one worker, got {workers}")
        self.workers = workers
        self._all = (1 << workers) - 1
        self._masks: dict[BlockKey, int] = {}

    def seed(self, rank: int, keys: Iterable[BlockKey]) -> None:
        """Blocks worker `rank` will find at start (files an earlier engine wrote), before it reports."""
        bit = self._bit(rank)
        for key in keys:
            self._masks[key] = self._masks.get(key, 0) | bit

    def apply(self, rank: int, report: RankReport) -> None:
        bit = self._bit(rank)
        if report.full:  # the worker's own listing replaces what was assumed of it
            for key in [k for k, m in self._masks.items() if m & bit]:
                self._clear(key, bit)
        for key in report.entered:
            self._masks[key] = self._masks.get(key, 0) | bit
        for key in report.left:
            self._clear(key, bit)

    def held(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` every worker holds."""
        for n, key in enumerate(keys):
            if self._masks.get(key, 0) != self._all:
                return n
        return len(keys)

    def __len__(self) -> int:
        """Blocks some worker holds."""
        return len(self._masks)

    def _bit(self, rank: int) -> int:
        if not 0 <= rank < self.workers:
            raise ValueError(f"worker rank {rank} outside 0..{self.workers - 1}")
        return 1 << rank

    def _clear(self, key: BlockKey, bit: int) -> None:
        mask = self._masks.get(key, 0) & ~bit
        if mask:
            self._masks[key] = mask
        else:
            self._masks.pop(key, None)
