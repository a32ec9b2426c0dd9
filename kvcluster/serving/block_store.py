"""Where a runner's prefix blocks come from and go to.

The runner calls `fetch` once per request with all of the prompt's block keys and
gets back the verified leading run, then `store` once with all of the request's
blocks: the fetched run and the blocks it computed. `store` is the request's one
use of its blocks, with what the policy knows of it (`served_context`), as the
simulator replays a trace request. The in-process form binds a `TieredStore` (the
policy engine's hierarchy over real backends); the Ray form (serve_apps) adds the
node's tier actors and remote nodes behind the same two calls.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from ..block_types import TransitionType
from ..keys import BlockKey
from ..policies.base import RequestContext
from ..storage.tiered import ResidencyLog, TieredStore


class BlockStore(Protocol):
    def fetch(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Payloads of the longest cached, verified prefix of `keys` (read into `out[j]` where the store can).
        A read only: the request's `store` counts the use."""

    def store(self, keys: Sequence[BlockKey], payloads: Sequence[np.ndarray | None],
              pairs: Sequence[int] | None = None, finish: str = "", output_tokens: int = 0,
              session: str = "", continues: bool = False) -> None:
        """After the request, all of its blocks: `payloads[j]` is block j's KV when this request computed it,
        else None (fetched, or held already);
        `pairs[j]` its (block type, transition) pair for the reuse predictor; `finish` (the API's
        finish reason) and `output_tokens` say how its answer ended and `session` whose request it
        was (the API's `user`, "" if none), which the eviction policy classes its blocks by
        (`policies/bayes.py`: a session's pace). `continues`: more blocks of the session's latest request,
        stored in parts (vLLM's connector: a later prefill chunk, blocks its answer completed)."""

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        """How the answer to `session`'s latest request ended, for a store that got its blocks before it was
        known (vLLM's connector stores them as the engine computes them): the policy re-classes them."""


class LocalBlockStore:
    """A TieredStore in this process (hbm, dram, ... backends), safe across threads.

    A request is one commit, at `store`: its fetched run and its new blocks together, with its context.
    Counted at `fetch` instead, the run would be a request of its own with no types, transition or
    session, and the new blocks another: `bayes` then closes far less of the gap than in the replay
    (RESULTS, "One control plane"). A block fetched and evicted before its request's `store` is left
    out of it: there are no bytes to keep."""

    device_buffers = True  # fetches fill device tensors (the memory tiers by DMA, the others from host copies)

    def __init__(self, tiered: TieredStore, clock: Callable[[], float] = time.monotonic) -> None:
        self.tiered = tiered
        self._clock = clock  # the policy's `now`; a replay passes the trace's arrival times
        self._lock = threading.Lock()
        self._requests = 0

    def fetch(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        with self._lock:
            return list(self.tiered.read(keys, out).payloads)

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
              session: str = "", continues: bool = False) -> None:
        if not keys:
            return
        with self._lock:
            self._requests += 1
            ctx = served_context(self._requests, self._clock(), pairs, finish, output_tokens, session, continues)
            self.tiered.commit(keys, payloads, ctx)

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        if session:
            with self._lock:
                self.tiered.answered(session, finish, output_tokens)

    def checkpoint(self) -> int:
        """Copy what the volatile tiers hold into the persistent one, for a clean shutdown
        (`TieredStore.checkpoint`); returns the blocks copied."""
        with self._lock:
            return self.tiered.checkpoint()

    def place(self, keys: Sequence[BlockKey], payloads: Sequence[np.ndarray]) -> None:
        """Keep blocks a request read from elsewhere (another node's tiers) without counting a use: that
        request's `store` counts it, with its context."""
        if not keys:
            return
        with self._lock:
            self.tiered.place(keys, payloads, RequestContext(index=self._requests, now=self._clock()))


def served_context(index: int, now: float, pairs: Sequence[int] | None, finish: str = "",
                   output_tokens: int = 0, session: str = "", continues: bool = False) -> RequestContext:
    """What the policy knows of a served request: its blocks' types and its transition (from their pairs), how
    its answer ended, and whose it was (the API's `user`; without one the policy's session gap stays "first
    request")."""
    if not pairs:
        return RequestContext(index=index, now=now, finish=finish, output_tokens=output_tokens, session=session,
                              continues=continues)
    n = len(TransitionType)
    return RequestContext(index=index, now=now, block_types=tuple(p // n for p in pairs), transition=pairs[0] % n,
                          finish=finish, output_tokens=output_tokens, session=session, continues=continues)
