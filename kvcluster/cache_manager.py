"""Where every block lives: the metadata half of the cache, apart from the bytes.

The manager keeps one `Hierarchy` of eviction policies over byte keys, built by
the same `build_hierarchy` the simulator replays, and turns each decision into a
`StorePlan`: for every block the request touched, the tier its bytes leave and
the tier they land in. A data plane carries the plan out (`plan_executor`:
backends in this process, or tier actors across a cluster) and reports which
blocks it could not move; those leave the bookkeeping, so the manager never
claims a block no tier holds.

Calls mirror an offloading manager's (vLLM's `kv_offload`, LMCache's storage
managers): `lookup` is the prefix run, `prepare_load`/`complete_load` pin the
blocks a reader is copying out (a pinned block is put back when a tier picks it
as a victim), `prepare_store`/`complete_store` bracket one request's placement,
`prepare_prefetch` lifts a queued request's held prefix into tier 0 before it runs
(the simulator's `Prefetcher`, so prefetch hits and waste count alike in both),
and `drain_events` yields what was stored, moved, evicted or lost, for an index
or a read-only replica of it. Plans are applied in the order they are issued:
a plan's sources are where the previous plan left the blocks.

Policies see blocks as small ints. A key keeps its id while some tier's policy
remembers the block (resident, or a ghost it learns from); once the keys known
reach twice what the last sweep kept, the others are let go and their ids are
given to new keys, so memory follows the tiers' capacities and not the keys ever
seen. No policy holds anything of an id let go, so a key that comes back, under
whatever id, is a block every policy meets as new, as the simulator's policies
would.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .hierarchy import Hierarchy, ServeResult, TierPlan, build_hierarchy
from .key_table import MIN_KEYS_SWEPT, KeyTable
from .policies.base import RequestContext
from .predictor import PredictorConfig
from .prefetch import Prefetcher


@dataclass(frozen=True, slots=True)
class Move:
    """One block's net move in a plan: tier indices, None for "nowhere"."""

    key: bytes
    src: int | None  # the tier its bytes are read from; None: bytes the caller computed
    dst: int | None  # the tier they land in; None: dropped (fell out of the last tier)


@dataclass(frozen=True)
class StorePlan:
    plan_id: int
    moves: tuple[Move, ...]

    def by_source(self) -> dict[int, list[bytes]]:
        """Keys to read, per source tier (moves that land somewhere)."""
        return _group((m.src, m.key) for m in self.moves if m.src is not None and m.dst is not None)

    def deletes(self) -> dict[int, list[bytes]]:
        """Keys that leave each tier: removed before anything is written, which makes the room."""
        return _group((m.src, m.key) for m in self.moves if m.src is not None)

    def writes(self) -> dict[int, list[Move]]:
        return _group((m.dst, m) for m in self.moves if m.dst is not None)


def _group(pairs: Iterable[tuple[int, object]]) -> dict:
    out: dict = {}
    for tier, item in pairs:
        out.setdefault(tier, []).append(item)
    return out


@dataclass(frozen=True, slots=True)
class Event:
    kind: str  # "stored" | "moved" | "evicted" | "lost"
    key: bytes
    tier: int | None  # where the block is now (None: nowhere)
    src: int | None = None  # where it was (moved, evicted, lost)


class CacheManager:
    def __init__(self, plan: Sequence[TierPlan], policy: str = "lru", *, policy_options: dict | None = None,
                 predictor_config: PredictorConfig | None = None, keys_swept_from: int = MIN_KEYS_SWEPT,
                 record_events: bool = True) -> None:
        self.names = [t.name for t in plan]
        self.policy = policy
        self.hierarchy: Hierarchy = build_hierarchy(policy, plan, predictor_config, policy_options=policy_options)
        self._table = KeyTable(keys_swept_from)
        self._ids, self._keys = self._table.ids, self._table.keys  # key -> id, id -> key (None: free)
        self._pins: Counter = Counter()  # block id -> readers copying it out
        self._plan_ids = itertools.count(1)
        self._events: list[Event] = []
        self.record_events = record_events  # off for an owner that reads none (a node controller)
        self._requests = 0
        self.prefetcher = Prefetcher(lead_s=0.0)  # the lead is the caller's: it says which requests are queued

    # -- keys ---------------------------------------------------------------------------------

    def _intern(self, keys: Iterable[bytes]) -> list[int]:
        return self._table.intern(keys)

    def _sweep_keys(self) -> None:
        """Let go of the keys of blocks no tier's policy remembers and no reader pins (`KeyTable.sweep`)."""
        policies, pins = self.hierarchy.policies, self._pins
        gone = self._table.sweep(lambda i: i in pins or any(p.remembers(i) for p in policies))
        if gone:
            self.prefetcher.forget(gone)  # one lost on a failed move may still be pending

    def _known(self, keys: Iterable[bytes]) -> list[int | None]:
        return self._table.known(keys)

    def _known_ids(self, keys: Iterable[bytes]) -> list[int]:
        return [i for i in self._known(keys) if i is not None]

    def tier_of(self, key: bytes) -> int | None:
        i = self._ids.get(key)
        return None if i is None else self.hierarchy.locate(i)

    # -- loads --------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Tier of each block of the leading run of `keys` that some tier holds."""
        out = []
        for i in self._known(keys):
            tier = None if i is None else self.hierarchy.locate(i)
            if tier is None:
                break
            out.append(tier)
        return out

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """`lookup`, with the run pinned until `complete_load`: no plan evicts it meanwhile."""
        tiers = self.lookup(keys)
        for i in self._known(keys[: len(tiers)]):
            self._pins[i] += 1
        return tiers

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.unpin(keys)

    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep these blocks where they are until `unpin`: a tier that picks one as a victim takes another
        (a reader copying it out, or a writer whose bytes are on the way in)."""
        for i in self._known_ids(keys):
            self._pins[i] += 1

    def unpin(self, keys: Sequence[bytes]) -> None:
        for i in self._known(keys):
            if i is not None and self._pins[i] > 0:
                self._pins[i] -= 1
                if not self._pins[i]:
                    del self._pins[i]

    def forget(self, keys: Sequence[bytes]) -> None:
        """Blocks whose bytes turned out unreadable (corrupt, lost with a process): no tier holds them."""
        for key, i in zip(keys, self._known(keys)):
            tier = None if i is None else self.hierarchy.locate(i)
            if tier is not None:
                self.hierarchy.policies[tier].discard([i])
                self._events.append(Event("lost", key, None, tier))

    def adopt(self, tier: int, keys: Sequence[bytes]) -> list[bytes]:
        """Blocks `tier` already holds (a restarted control plane rebuilding its view from the tiers).
        Returns the keys to delete there: those another tier holds already, and the policy's victims
        when the tier holds more than its capacity."""
        ids = self._intern(keys)
        fresh = [i for i in ids if self.hierarchy.locate(i) is None]
        extra = [self._keys[i] for i in ids if self.hierarchy.locate(i) not in (None, tier)]
        victims = self.hierarchy.policies[tier].admit(fresh, RequestContext(index=self._requests, now=0.0))
        extra += [self._keys[i] for i in victims]
        self._sweep_keys()
        return extra

    def forget_tier(self, tier: int) -> int:
        """Everything `tier` was thought to hold is gone (its process restarted empty)."""
        policy = self.hierarchy.policies[tier]
        gone = list(policy.resident())
        policy.discard(gone)
        self._events.extend(Event("lost", self._keys[i], None, tier) for i in gone)
        return len(gone)

    # -- stores -------------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[bytes], computed: Iterable[bytes] = (),
                      ctx: RequestContext | None = None) -> StorePlan:
        """Serve one request in the hierarchy (all its blocks become resident in tier 0; victims fall)
        and return the moves that make the tiers match. `computed`: blocks this request produced the
        bytes of; a block neither held by a tier nor computed is left out (there is nothing to store)."""
        computed = set(computed)
        ids = self._intern(keys)
        top = self.hierarchy.policies[0]
        src: dict[int, int | None] = {}  # where each touched block's bytes are now
        skipped: set[int] = set()
        served: list[int] = []
        for key, i in zip(keys, ids):
            if i not in src and i not in skipped:
                if i in top:
                    src[i] = 0
                elif key in computed:
                    src[i] = None  # new, unless a lower tier holds it: then `promoted` says which
                else:
                    where = self.hierarchy.locate(i)
                    if where is None:  # no bytes anywhere: nothing to store
                        skipped.add(i)
                        continue
                    src[i] = where
            if i not in skipped:
                served.append(i)
        self._requests += 1
        if ctx is None:
            ctx = RequestContext(index=self._requests, now=float(self._requests))
        result = self.hierarchy.serve(served, ctx, self._pins)
        self.prefetcher.served(served, result.hit_tier)
        self.prefetcher.after(result)
        plan = self._plan(src, result)
        self._sweep_keys()
        return plan

    def prepare_prefetch(self, keys: Sequence[bytes], ctx: RequestContext | None = None) -> StorePlan:
        """A queued request's held prefix, lifted into tier 0 before it runs (no use is counted: its own
        `prepare_store` counts it). The plan is empty when that run is in tier 0 already."""
        run = self._known(keys)
        run = run[: next((j for j, i in enumerate(run) if i is None), len(run))]
        if ctx is None:
            ctx = RequestContext(index=self._requests, now=float(self._requests))
        result = self.prefetcher.prefetch(self.hierarchy, run, ctx, self._pins)
        if result is None:
            return StorePlan(next(self._plan_ids), ())
        return self._plan({b: tier for b, tier in result.promoted}, result)

    def prepare_place(self, keys: Sequence[bytes], ctx: RequestContext | None = None) -> StorePlan:
        """Blocks whose bytes the caller read from elsewhere, placed in tier 0 without counting a use (the
        request that read them counts it at its `prepare_store`); those a tier holds stay put."""
        fresh = [i for i in dict.fromkeys(self._intern(keys)) if self.hierarchy.locate(i) is None]
        if ctx is None:
            ctx = RequestContext(index=self._requests, now=float(self._requests))
        result = self.hierarchy.place(fresh, ctx, self._pins)
        self.prefetcher.after(result)
        plan = self._plan(dict.fromkeys(fresh), result)  # from the caller's bytes; dropped at once: no move
        self._sweep_keys()
        return plan

    def _plan(self, src: dict[int, int | None], result: ServeResult) -> StorePlan:
        """The net moves that make the tiers match the hierarchy after `result`. `src`: where each block the
        request touched has its bytes now (None: computed by the caller)."""
        for block, tier in result.promoted:
            src[block] = tier
        dst = dict.fromkeys(src, 0)  # every touched block ends in tier 0 unless it fell in the same cascade
        for block, origin, landed in result.demoted:  # in cascade order: the last landing is where it stays
            src.setdefault(block, origin)
            dst[block] = landed
        for block, origin in zip(result.dropped, result.dropped_from):
            src.setdefault(block, origin)
            dst[block] = None
        keys_of = self._keys
        moves = [Move(keys_of[b], s, dst[b]) for b, s in src.items() if s != dst[b]]
        return StorePlan(next(self._plan_ids), tuple(moves))

    def prefetch_stats(self) -> dict[str, int]:
        """Blocks prefetched (issued), then used from tier 0 (hits), or evicted first (wasted)."""
        return dict(self.prefetcher.stats.__dict__)

    def complete_store(self, plan: StorePlan, failed: Iterable[bytes] = ()) -> None:
        """The data plane carried `plan` out except for `failed` blocks (unreadable source, refused
        write): those leave the tier the plan put them in."""
        failed = set(failed)
        if not self.record_events and not failed:
            return  # nothing to undo, and nobody reads the events
        for m in plan.moves:
            if not self.record_events and m.key not in failed:
                continue
            if m.key in failed:
                i = self._ids.get(m.key)
                if m.dst is not None and i is not None:  # a key let go since is in no tier
                    self.hierarchy.policies[m.dst].discard([i])
                self._events.append(Event("lost", m.key, None, m.src))
            elif m.src is None:
                self._events.append(Event("stored", m.key, m.dst))
            elif m.dst is None:
                self._events.append(Event("evicted", m.key, None, m.src))
            else:
                self._events.append(Event("moved", m.key, m.dst, m.src))

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        """How the answer to `session`'s latest request ended, once known after its blocks were stored (vLLM
        stores a request's blocks before it finishes): the policies re-class them. Moves no block."""
        self.hierarchy.answered(session, finish, output_tokens)

    def drain_events(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    # -- views --------------------------------------------------------------------------------

    def occupancy(self) -> dict[str, int]:
        return {name: len(p) for name, p in zip(self.names, self.hierarchy.policies)}

    def resident(self) -> Mapping[str, list[bytes]]:
        return {name: [self._keys[i] for i in p.resident()] for name, p in zip(self.names, self.hierarchy.policies)}

    def counters(self) -> list[dict]:
        return [{"name": n, **c.__dict__} for n, c in zip(self.names, self.hierarchy.counters)]

    def sessions_known(self) -> int:
        """Sessions whose pace the first tier's policy remembers (the one that sees every request)."""
        return max((p.sessions_known for p in self.hierarchy.policies), default=0)

    def tracked(self) -> int:
        return len(self._ids)
