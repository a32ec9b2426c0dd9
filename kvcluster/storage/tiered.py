"""The cache manager and the plan executor over backends in this process.

`fetch` finds a request's prefix run across the tiers (`CacheManager.lookup`) and
loads it with one `read_verified` per tier; a missing or corrupt payload ends the
run there (the rest is recomputed, never served wrong) and the block leaves the
bookkeeping. `commit` then lets the manager place the request (the same hierarchy
and policies the simulator replays) and runs its plan (`plan_executor.execute`):
promoted blocks are written to tier 0 from the bytes just fetched, new blocks are
stored, victims move down with the digest their tier verified, and blocks falling
off the last tier are deleted. A put a backend refuses leaves that block a miss.
Capacities are the backends' bytes / the layout's block bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..cache_manager import CacheManager, Event
from ..control_plane import ControlPlane
from ..keys import BlockKey
from ..plan_executor import BackendTierIO
from ..policies.base import RequestContext
from ..hierarchy import TierPlan
from .base import SlottedBackend, StorageBackend


@dataclass(frozen=True)
class FetchResult:
    hits: int  # blocks of the verified prefix run
    payloads: tuple[np.ndarray, ...]  # their bytes, in order
    tiers: tuple[str, ...]  # the tier each came from
    dropped_corrupt: int  # blocks found in the index whose bytes failed verification


class ResidencyLog:
    """Which blocks entered or left a store's tiers since last asked: what a process that cannot see the
    store (vLLM's scheduler, when the workers run in processes of their own) needs to know what it holds.
    Moves between tiers change nothing; a block stored and then evicted before the next `take` left."""

    def __init__(self) -> None:
        self._now_held: dict[BlockKey, bool] = {}  # net state of each block changed since the last take

    def record(self, events: Sequence[Event]) -> None:
        for event in events:
            if event.kind == "stored":
                self._now_held[BlockKey(event.key)] = True
            elif event.kind in ("evicted", "lost"):
                self._now_held[BlockKey(event.key)] = False

    def take(self) -> tuple[list[BlockKey], list[BlockKey]]:
        """(blocks held now, blocks gone) among those that changed since the last call."""
        changed, self._now_held = self._now_held, {}
        return [k for k, held in changed.items() if held], [k for k, held in changed.items() if not held]


def capacity_blocks(backend: StorageBackend, block_bytes: int) -> int:
    """Blocks `backend` holds: one per slot where it has slots (the nvme slab aligns them, so a small block
    takes more bytes than its own), else its bytes over a block's."""
    if isinstance(backend, SlottedBackend):
        return backend.table.slots if backend.slot_bytes >= block_bytes else 0
    return backend.capacity_bytes // block_bytes


class TieredStore:
    def __init__(self, backends: Sequence[StorageBackend], block_bytes: int, policy: str = "lru", **policy_options):
        self.backends = list(backends)
        self.block_bytes = block_bytes
        plan = [TierPlan(b.name, capacity_blocks(b, block_bytes)) for b in self.backends]
        self.manager = CacheManager(plan, policy, policy_options=policy_options)
        self.hierarchy = self.manager.hierarchy
        self.plane = ControlPlane(self.manager, BackendTierIO(self.backends))
        self._fetched: dict[BlockKey, tuple[np.ndarray, int | None]] = {}  # what `fetch` read, with digests
        self.evictions = [0] * len(self.backends)  # blocks each tier gave up by policy decision, so far
        self.residency: ResidencyLog | None = None  # set to follow which blocks the tiers hold (`ResidencyLog`)

    def fetch(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> FetchResult:
        """Load the longest cached prefix of `keys`: one batched read per tier (into `out[j]` when given). The
        next `commit` promotes what it read from these bytes (one request at a time: see `read`)."""
        result, got = self._read(keys, out)
        self._fetched = {k: (p, d) for k, p, d in zip(keys, got.payloads, got.digests)}
        return result

    def read(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> FetchResult:
        """`fetch` for callers with several requests between a read and its commit: nothing is kept for the
        commit, which reads a block it promotes from its tier again (`out` may be reused by then)."""
        return self._read(keys, out)[0]

    def _read(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None):
        got = self.plane.fetch(keys, out)
        self._drain_events()  # a corrupt block left the tiers
        return FetchResult(len(got.payloads), got.payloads, tuple(self.backends[t].name for t in got.tiers),
                           got.corrupt), got

    def commit(self, keys: Sequence[BlockKey], new_payloads: Sequence[np.ndarray | None], ctx: RequestContext) -> None:
        """After a request ran: make its blocks resident per the policy and move the bytes.

        `new_payloads[j]` is the KV of block j when it was computed by this request
        (None for blocks that came from `fetch`).
        """
        held = dict(self._fetched)
        for key, p in zip(keys, new_payloads):
            if p is not None:  # computed by this request: no digest yet
                held[key] = (p, None)
        plan, _ = self.plane.commit(keys, held, ctx)
        for m in plan.moves:
            if m.src is not None and (m.dst is None or m.dst > m.src):
                self.evictions[m.src] += 1
        self._drain_events()
        self._fetched = {}

    def place(self, keys: Sequence[BlockKey], payloads: Sequence[np.ndarray], ctx: RequestContext) -> None:
        """Blocks read from elsewhere (another node's tiers), kept here without counting a use: the request
        that read them counts it at its `commit`."""
        self.plane.place(keys, {k: (p, None) for k, p in zip(keys, payloads)}, ctx)
        self._drain_events()

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        """How the answer to `session`'s latest request ended, told after its `commit` (`CacheManager.answered`)."""
        self.manager.answered(session, finish, output_tokens)

    def checkpoint(self, batch: int = 64) -> int:
        """Copy the blocks of the volatile tiers into the last persistent one (a `pfs` directory), as far as its
        free room allows, fastest tier first; returns the blocks copied.

        For a clean shutdown: a restarted store adopts the persistent tier's files (the memory tiers and the
        nvme slab, whose index lives in memory, start empty), so what was held at the stop comes back. The
        bookkeeping is left as it is: the store is about to close, and the copies are verified reads of
        acknowledged blocks."""
        from .pfs import PFSBackend

        durable = [i for i, b in enumerate(self.backends) if isinstance(b, PFSBackend)]
        if not durable:
            return 0
        target = self.backends[durable[-1]]
        copied = 0
        for tier, keys in enumerate(self.manager.resident().values()):
            if tier >= durable[-1]:
                break
            for start in range(0, len(keys), batch):
                chunk = [BlockKey(k) for k in keys[start:start + batch]]
                payloads, digests = self.backends[tier].read_verified(chunk)
                items = [(k, p, d) for k, p, d in zip(chunk, payloads, digests) if p is not None]
                if not items:
                    continue
                ok = target.put_many([(k, p) for k, p, _ in items], [d for _, _, d in items])
                copied += sum(ok)
                if not all(ok) and target.used_bytes + self.block_bytes > target.capacity_bytes:
                    return copied  # the persistent tier is full
        return copied

    def _drain_events(self) -> None:
        events = self.manager.drain_events()
        if self.residency is not None:
            self.residency.record(events)

    def check_integrity(self) -> None:
        """Every block the hierarchy holds in a tier is readable from that tier's backend."""
        self.hierarchy.check_integrity()
        for (name, resident), backend in zip(self.manager.resident().items(), self.backends):
            present = backend.contains(resident)
            assert all(present), f"{backend.name}: the index holds blocks the backend lacks"
            backend.check_integrity()
