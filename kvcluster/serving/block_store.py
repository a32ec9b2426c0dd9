"""Where a runner's prefix blocks come from and go to.

The runner calls `fetch` once per request with all of the prompt's block keys and
gets back the verified leading run, then `store` once with the blocks it
computed. The in-process form binds a `TieredStore` (the policy engine's
hierarchy over real backends); the Ray form (serve_apps) adds the node's tier
actors and remote nodes behind the same two calls.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, Sequence

import numpy as np

from ..keys import BlockKey
from ..policies.base import RequestContext
from ..storage.tiered import ResidencyLog, TieredStore


class BlockStore(Protocol):
    def fetch(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Payloads of the longest cached, verified prefix of `keys` (read into `out[j]` where the store can)."""

    def store(self, keys: Sequence[BlockKey], payloads: Sequence[np.ndarray | None],
              pairs: Sequence[int] | None = None, finish: str = "", output_tokens: int = 0,
              session: str = "") -> None:
        """After the request: `payloads[j]` is block j's KV when this request computed it, else None;
        `pairs[j]` its (block type, transition) pair for the reuse predictor; `finish` (the API's
        finish reason) and `output_tokens` say how its answer ended and `session` whose request it
        was (the API's `user`, "" if none), which the eviction policy classes its blocks by
        (`policies/bayes.py`: a session's pace)."""


class LocalBlockStore:
    """A TieredStore in this process (hbm, dram, ... backends), safe across threads."""

    device_buffers = True  # fetches fill device tensors (the memory tiers by DMA, the others from host copies)

    def __init__(self, tiered: TieredStore) -> None:
        self.tiered = tiered
        self._lock = threading.Lock()
        self._requests = 0

    def fetch(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        with self._lock:
            result = self.tiered.fetch(keys, out)
            fetched = list(result.payloads)
            self._commit(keys[: len(fetched)], [None] * len(fetched))  # the hits count as uses now
            return fetched

    def held(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` the tiers hold (a lookup: no use is recorded)."""
        with self._lock:
            return len(self.tiered.manager.lookup(keys))

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each block is in some tier."""
        with self._lock:
            return [self.tiered.manager.tier_of(k) is not None for k in keys]

    def residency_changes(self) -> tuple[list[BlockKey], list[BlockKey], bool]:
        """(blocks that entered the tiers, blocks that left them, whether this is a full listing) since the
        last call. The first call lists every block held (those adopted from files included) and starts
        following the changes."""
        with self._lock:
            if self.tiered.residency is None:
                self.tiered.residency = ResidencyLog()
                held = [BlockKey(k) for keys in self.tiered.manager.resident().values() for k in keys]
                return held, [], True
            entered, left = self.tiered.residency.take()
            return entered, left, False

    def store(self, keys: Sequence[BlockKey], payloads: Sequence[np.ndarray | None],
              pairs: Sequence[int] | None = None, finish: str = "", output_tokens: int = 0,
              session: str = "") -> None:
        new = [(k, p) for k, p in zip(keys, payloads) if p is not None]  # the hits were committed at fetch
        with self._lock:
            self._commit([k for k, _ in new], [p for _, p in new], finish, output_tokens, session)

    def _commit(self, keys: Sequence[BlockKey], payloads: Sequence[np.ndarray | None], finish: str = "",
                output_tokens: int = 0, session: str = "") -> None:
        if not keys:
            return
        self._requests += 1
        self.tiered.commit(keys, payloads, RequestContext(index=self._requests, now=time.monotonic(), finish=finish,
                                                          output_tokens=output_tokens, session=session))
