"""One node's control plane: its cache manager, with the writer of new blocks apart from it.

A node's engines write the KV they compute straight into the node's tiers; the
controller only decides where, and makes room first. A store is two calls, as in
vLLM's `kv_offload` (`prepare_store` -> the writer's copy -> `complete_store`):

1. `prepare_store(keys, new, ctx)`: the manager serves the request with the
   node's policy; the plan's moves between tiers (promotions of the blocks the
   request used, demotions and drops of the victims) run now through the `Mover`,
   tier to tier; the caller gets a `StoreTicket` naming the tier each new block
   goes to. Those blocks are pinned: no later plan picks them as victims while
   their bytes are on the way.
2. The caller writes the bytes into those tiers itself (no KV byte is an
   argument of a control call), deleting first the victims the ticket hands it
   (a tier that only the caller writes into makes its room in the same call),
   and calls `complete_store(plan_id, failed)`.
   Blocks a tier refused leave the bookkeeping: a miss, never a block claimed
   where it is not.

A ticket not completed within `lease_s` (its writer died) expires: its blocks
leave the bookkeeping and whatever of them landed late is deleted. Pure logic: the
Ray side binds the mover to the node's tier actors.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from .cache_manager import CacheManager, StorePlan
from .policies.base import RequestContext

DEFAULT_LEASE_S = 120.0


class Mover(Protocol):
    def run(self, plan: StorePlan) -> list[bytes]:
        """Carry out the moves whose source is a tier; returns the keys that did not reach their tier."""

    def delete(self, keys: Mapping[int, list[bytes]]) -> None: ...


@dataclass(frozen=True)
class StoreTicket:
    plan_id: int  # unique across restarts of the controller: a stale ticket is never taken for a new one
    writes: dict[int, list[bytes]]  # tier index -> the caller's new blocks that go there, in request order
    evict: dict[int, list[bytes]] = field(default_factory=dict)  # tier -> victims the caller deletes there first


class NodeController:
    def __init__(self, manager: CacheManager, mover: Mover, lease_s: float = DEFAULT_LEASE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.manager = manager
        self.mover = mover
        self.lease_s = lease_s
        self.clock = clock
        self._pending: dict[int, tuple[StorePlan, float, dict[int, list[bytes]]]] = {}
        self._epoch = secrets.randbits(30) << 32  # this incarnation's tickets: epoch + the manager's plan id
        self.counters = {"stores": 0, "moves": 0, "move_failures": 0, "written": 0, "refused": 0, "expired": 0}

    def prepare_store(self, keys: Sequence[bytes], new: Sequence[bytes], ctx: RequestContext | None = None
                      ) -> StoreTicket:
        """Place one request served on this node; `new`: the blocks whose bytes the caller computed (or read
        elsewhere) and will write. Returns where each of those goes (a block the policy lets go at once is in
        no tier of the ticket: nothing to write), and the victims the caller deletes from a tier in the same
        call that writes there (`evict`): a drop from a tier only the caller writes into costs no call here."""
        self.expire()
        plan = self.manager.prepare_store(keys, new, ctx)
        mine = StorePlan(plan.plan_id, tuple(m for m in plan.moves if m.src is None))
        caller_tiers = {m.dst for m in mine.moves}
        mover_tiers = {m.dst for m in plan.moves if m.src is not None and m.dst is not None}
        handed = [m for m in plan.moves if m.src is not None and m.dst is None and m.src in caller_tiers
                  and m.src not in mover_tiers]
        handed_keys = {m.key for m in handed}
        theirs = StorePlan(plan.plan_id, tuple(m for m in plan.moves
                                               if m.src is not None and m.key not in handed_keys))
        failed = self.mover.run(theirs) if theirs.moves else []
        self.manager.complete_store(StorePlan(plan.plan_id, theirs.moves + tuple(handed)), failed)
        self.counters["stores"] += 1
        self.counters["moves"] += len(theirs.moves) + len(handed)
        self.counters["move_failures"] += len(failed)
        writes: dict[int, list[bytes]] = {}
        for m in mine.moves:
            writes.setdefault(m.dst, []).append(m.key)
        evict: dict[int, list[bytes]] = {}
        for m in handed:
            evict.setdefault(m.src, []).append(m.key)
        if mine.moves:
            self.manager.pin([m.key for m in mine.moves])
            self._pending[self._epoch + plan.plan_id] = (mine, self.clock(), evict)
        return StoreTicket(self._epoch + plan.plan_id, writes, evict)

    def complete_store(self, plan_id: int, failed: Sequence[bytes] = (),
                       landed: Mapping[int, Sequence[bytes]] | None = None,
                       evicted: Mapping[int, Sequence[bytes]] | None = None) -> bool:
        """The caller wrote its ticket's blocks except `failed`; `landed`: where it wrote them (tier ->
        keys); `evicted`: the victims it deleted there. False when this controller has no such ticket (it
        expired, or was issued before a restart): then each landed block this manager does not count in that
        tier is deleted there, and each evicted one it counts there is forgotten, so bytes and bookkeeping
        agree whichever came first, the writer's call or the restart's adoption."""
        entry = self._pending.pop(plan_id, None)
        if entry is None:
            failed = set(failed)
            stray = {t: [k for k in ks if k not in failed and self.manager.tier_of(k) != t]
                     for t, ks in (landed or {}).items()}
            stray = {t: ks for t, ks in stray.items() if ks}
            if stray:
                self.mover.delete(stray)
            gone = [k for t, ks in (evicted or {}).items() for k in ks if self.manager.tier_of(k) == t]
            if gone:
                self.manager.forget(gone)
            return False
        plan, _, _ = entry
        self._settle(plan, set(failed))
        return True

    def expire(self) -> int:
        """Tickets past their lease: their blocks count as never written. Returns how many expired."""
        now = self.clock()
        old = [pid for pid, (_, t, _) in self._pending.items() if now - t > self.lease_s]
        for pid in old:
            plan, _, evict = self._pending.pop(pid)
            self._settle(plan, {m.key for m in plan.moves})
            gone = {t: list(ks) for t, ks in evict.items()}  # victims the writer may never have deleted
            for m in plan.moves:  # and blocks it may have written: neither is in the bookkeeping now
                gone.setdefault(m.dst, []).append(m.key)
            self.mover.delete(gone)
        self.counters["expired"] += len(old)
        return len(old)

    def _settle(self, plan: StorePlan, failed: set[bytes]) -> None:
        """Unpin the plan's blocks and record what landed. A written block no longer where the ticket put it
        (a plan fell on it while every candidate of its tier was pinned, or its ticket expired) is deleted
        where it landed, so a tier never holds bytes its manager does not count."""
        keys = [m.key for m in plan.moves]
        self.manager.unpin(keys)
        self.manager.complete_store(plan, failed)
        stray: dict[int, list[bytes]] = {}
        for m in plan.moves:  # a refused block never landed; one that landed is where its ticket said, or stray
            if m.key not in failed and self.manager.tier_of(m.key) != m.dst:
                stray.setdefault(m.dst, []).append(m.key)
        if stray:
            self.mover.delete(stray)
        self.counters["written"] += len(keys) - len(failed)
        self.counters["refused"] += len(failed)

    def in_flight(self) -> int:
        """Tickets whose writer has not completed them yet."""
        return len(self._pending)
