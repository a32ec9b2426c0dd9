"""`bayes-hd`: evict the block with the lowest hit density, learnt as a reuse-gap hazard per class.

Each block is classed at its last use by what is known then: its (block type,
transition) pair, how often it was used before (0, 1, 2, 3+), and whether it
ends its request (a request's last block is usually partial and rarely comes
back). `GapModel` learns per class the hazard of reuse by age (log-spaced bins,
Beta posteriors pooled across classes), and from it the LHD hit density:
expected reuses per second of cache held, given the block's current age. The
victim is the block of least density; a new block whose class is worth less
than everything resident leaves at once (the bypass Belady makes).

Cheap by construction: blocks of one request and one class form a group, and
groups of a class queue in last-use order, so the candidates are the oldest
group of each class (density is read per class and age bin from a table
refreshed every few dozen requests). A request costs one dict write per block,
one pass over the class heads, and O(log classes) per victim.

Prefix semantics: a group is evicted from its tail, so within a request and a
class a block never leaves before the blocks that extend it. Across classes it
can: a deeper block of a denser class (e.g. reused more often) may outlive its
prefix. This is what the learnt densities say to do; such an orphan then has the
lowest density of its class soon (it stops being hit) and ages out.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Sequence

from ..block_types import NUM_PAIRS, BlockType, TransitionType
from ..reuse_gap import GapModel, GapModelConfig, age_bin
from .base import EvictionPolicy, RequestContext
from .registry import register

_NT = len(TransitionType)
USE_BUCKETS = 4  # uses before this one: 0, 1, 2, 3+
SESSION_BUCKETS = 4  # the session's last inter-request gap: none yet, < 8 s, < 64 s, longer
CLASSES = SESSION_BUCKETS * NUM_PAIRS * USE_BUCKETS * 2
_PER_SESSION_BUCKET = NUM_PAIRS * USE_BUCKETS * 2


def session_bucket(gap_s: float | None) -> int:
    """Bucket of a session's last gap between requests (None: this is its first)."""
    if gap_s is None:
        return 0
    return 1 if gap_s < 8.0 else (2 if gap_s < 64.0 else 3)


def class_of(block_type: int, transition: int, uses_before: int, last_in_request: bool, session: int = 0) -> int:
    """Class index of a block used now (`session` from `session_bucket`)."""
    u = uses_before if uses_before < USE_BUCKETS else USE_BUCKETS - 1
    return session * _PER_SESSION_BUCKET + ((block_type * _NT + transition) * USE_BUCKETS + u) * 2 + int(last_in_request)


def describe_class(cls: int) -> dict:
    """The features a class index stands for."""
    session, cls = divmod(cls, _PER_SESSION_BUCKET)
    rest, last = divmod(cls, 2)
    pair, uses = divmod(rest, USE_BUCKETS)
    bt, tt = divmod(pair, _NT)
    return {"block_type": BlockType(bt).name.lower(), "transition": TransitionType(tt).name.lower(),
            "uses_before": f"{uses}+" if uses == USE_BUCKETS - 1 else str(uses), "last_in_request": bool(last),
            "session_gap": ("first request", "< 8 s", "< 64 s", ">= 64 s")[session]}


# uses bucket of a block's next class, from its current class (class layout above)
_NEXT_USES = [min(((c >> 1) % USE_BUCKETS) + 1, USE_BUCKETS - 1) * 2 for c in range(CLASSES)]


@register
class BayesHDPolicy(EvictionPolicy):
    """Hit-density eviction from a learnt per-class reuse-gap hazard."""

    name = "bayes-hd"

    def __init__(self, capacity: int, gap_config: GapModelConfig | None = None, refresh_requests: int = 32,
                 horizon_factor: float = 4.0) -> None:
        super().__init__(capacity)
        if refresh_requests < 1 or horizon_factor <= 0:
            raise ValueError("refresh_requests must be >= 1 and horizon_factor > 0")
        self.model = GapModel(CLASSES, gap_config)
        self._base, self._lastbin = self.model.base, self.model.config.bins - 1
        self._edges = self.model.edges
        self._refresh_every = refresh_requests
        self._horizon_factor = horizon_factor
        self._last: dict[int, int] = {}  # block -> group of its last use; ~group when not resident
        self._gtime: list[float] = []  # per group: time of use
        self._gcls: list[int] = []  # per group: class
        self._galive: list[int] = []  # per group: blocks whose last use it still is (for the hazard)
        self._gblocks: dict[int, list[int]] = {}  # queued group -> blocks not yet popped, prefix first
        self._queues: list[deque[int]] = [deque() for _ in range(CLASSES)]
        self._active: set[int] = set()  # classes with a non-empty queue
        self._crossing: list[deque[int]] = [deque() for _ in range(self.model.config.bins)]
        self._size = 0
        self._requests = 0
        self._evict_age = 0.0  # EMA of victims' ages: how long a block lasts here
        self._dens = [[0.0] * self.model.config.bins for _ in range(CLASSES)]
        self._hazards = self.model.all_hazards()  # as of the last refresh
        self._sessions: dict[str, tuple[float, int]] = {}  # session -> (last request time, gap bucket)

    def __contains__(self, block: int) -> bool:
        return self._last.get(block, -1) >= 0

    def __len__(self) -> int:
        return self._size

    def resident(self):
        return [b for b, g in self._last.items() if g >= 0]

    def prefix_hits(self, blocks: Sequence[int]) -> int:
        get, n = self._last.get, 0
        for block in blocks:
            if get(block, -1) < 0:
                return n
            n += 1
        return n

    # -- learning ---------------------------------------------------------------------------------

    def _cross(self, now: float) -> None:
        """Count the blocks of every group that just reached a new age bin unused."""
        edges, crossing, gtime, galive, gcls = self._edges, self._crossing, self._gtime, self._galive, self._gcls
        reached = self.model.reached
        last = self._lastbin
        for k in range(1, last + 1):
            q = crossing[k]
            edge = edges[k]
            while q and gtime[q[0]] + edge <= now:
                g = q.popleft()
                alive = galive[g]
                if alive > 0:
                    reached[gcls[g]][k] += alive
                    if k < last:
                        crossing[k + 1].append(g)

    def _refresh(self, now: float) -> None:
        horizon = age_bin(self._evict_age * self._horizon_factor, self._base, self._lastbin)
        self._hazards = self.model.all_hazards()
        self._dens = self.model.densities(horizon, self._hazards)

    def predict_within(self, blocks: Sequence[int], ctx: RequestContext, horizon_s: float) -> list[float]:
        """P(each block is used again within `horizon_s` of this request), before `access` sees it.

        Read-only: the classes `access` would give the blocks, and the current
        posterior hazards (for calibration against what the trace then does)."""
        n = len(blocks)
        types = ctx.block_types or (int(BlockType.HISTORY),) * n
        seen = self._sessions.get(ctx.session)
        sb = 0 if seen is None else session_bucket(ctx.now - seen[0])
        if seen is not None and ctx.now - seen[0] < 0.5 * self._base:
            sb = seen[1]
        last, gcls, memo, out = self._last, self._gcls, {}, []
        for j, b in enumerate(blocks):
            old = last.get(b)
            nxt = 0 if old is None else _NEXT_USES[gcls[old if old >= 0 else ~old]]
            cls = sb * _PER_SESSION_BUCKET + (types[j] * _NT + ctx.transition) * USE_BUCKETS * 2 + nxt + (j == n - 1)
            p = memo.get(cls)
            if p is None:
                p = memo[cls] = self.model.p_reuse_within(cls, 0.0, horizon_s, self._hazards[cls])
            out.append(p)
        return out

    # -- the policy -------------------------------------------------------------------------------

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        now = ctx.now
        self._cross(now)
        self._requests += 1
        if self._requests % self._refresh_every == 1 or self._refresh_every == 1:
            self._refresh(now)
        n = len(blocks)
        if not n:
            return []
        types = ctx.block_types or (int(BlockType.HISTORY),) * n
        trans = ctx.transition
        seen = self._sessions.get(ctx.session)
        sb = 0 if seen is None else session_bucket(now - seen[0])
        if seen is not None and now - seen[0] < 0.5 * self._base:
            sb = seen[1]  # the same burst: keep the bucket of the gap before it
        if ctx.session:
            self._sessions[ctx.session] = (now, sb)
        sbase = sb * _PER_SESSION_BUCKET
        last, gtime, gcls, galive = self._last, self._gtime, self._gcls, self._galive
        reused, reached = self.model.reused, self.model.reached
        base, lastbin = self._base, self._lastbin
        start = len(gtime)
        gid = start - 1
        cur_cls = -1
        members: list[int] = []
        run_old, run_n = -1, 0
        new = 0
        tail = n - 1
        for j in range(n):
            b = blocks[j]
            old = last.get(b)
            if old is None:
                nxt = 0
                new += 1
            else:
                if old < 0:
                    old = ~old
                    new += 1
                if old >= start:  # repeated within this request
                    continue
                if old != run_old:
                    if run_n:
                        gap = now - gtime[run_old]
                        reused[gcls[run_old]][0 if gap < base else min(int(gap / base).bit_length(), lastbin)] += run_n
                        galive[run_old] -= run_n
                    run_old, run_n = old, 0
                run_n += 1
                nxt = _NEXT_USES[gcls[old]]
            cls = sbase + ((types[j] * _NT + trans) * USE_BUCKETS * 2) + nxt + (j == tail)
            if cls != cur_cls:
                if members:
                    self._enqueue(gid, cur_cls, members)
                gid += 1
                gtime.append(now)
                gcls.append(cls)
                galive.append(0)
                members = []
                cur_cls = cls
            last[b] = gid
            members.append(b)
        if run_n:
            gap = now - gtime[run_old]
            reused[gcls[run_old]][0 if gap < base else min(int(gap / base).bit_length(), lastbin)] += run_n
            galive[run_old] -= run_n
        if members:
            self._enqueue(gid, cur_cls, members)
        self._size += new
        return self._evict(now) if self._size > self.capacity else []

    def _enqueue(self, gid: int, cls: int, members: list[int]) -> None:
        m = len(members)
        self._galive[gid] = m
        self.model.reached[cls][0] += m
        self._crossing[1].append(gid)
        self._gblocks[gid] = members
        self._queues[cls].append(gid)
        self._active.add(cls)

    def admit(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        """Demoted blocks keep the class and last-use time they had above; no use is counted."""
        last, gtime, gcls = self._last, self._gtime, self._gcls
        by_group: dict[int, list[int]] = {}
        for b in blocks:
            g = last.get(b)
            if g is not None and g >= 0:
                continue  # already resident here
            by_group.setdefault(~g if g is not None else -1, []).append(b)
        for old, members in by_group.items():
            gid = len(gtime)
            if old >= 0:
                gtime.append(gtime[old])
                cls = gcls[old]
                self._galive[old] -= len(members)
            else:
                gtime.append(ctx.now)
                cls = class_of(int(BlockType.HISTORY), ctx.transition, 0, False)
            gcls.append(cls)
            self._galive.append(len(members))
            for b in members:
                last[b] = gid
            self._gblocks[gid] = members
            self._queues[cls].append(gid)
            self._active.add(cls)
            self._size += len(members)
        return self._evict(ctx.now) if self._size > self.capacity else []

    def _evict(self, now: float) -> list[int]:
        """Victims from the ends of the class queues, least dense first.

        Both ends of a class are candidates: its oldest group (density falling
        with age: the class is done) and its newest (density rising with age: the
        class comes back after a gap, so a fresh block is the one not worth its
        wait, the bypass Belady does on cyclic traffic)."""
        need = self._size - self.capacity
        last, gtime, gblocks, queues, dens = self._last, self._gtime, self._gblocks, self._queues, self._dens
        base, lastbin = self._base, self._lastbin
        heads = []
        for c in list(self._active):
            q = queues[c]
            while q and not gblocks[q[0]]:
                del gblocks[q.popleft()]
            while q and not gblocks[q[-1]]:
                del gblocks[q.pop()]
            if not q:
                self._active.discard(c)
                continue
            row = dens[c]
            g = q[0]
            age = now - gtime[g]
            heads.append((row[0 if age < base else min(int(age / base).bit_length(), lastbin)], -age, c, g, 0))
            g = q[-1]
            if g != q[0]:
                age = now - gtime[g]
                heads.append((row[0 if age < base else min(int(age / base).bit_length(), lastbin)], -age, c, g, 1))
        heapq.heapify(heads)
        evicted: list[int] = []
        ages = 0.0
        while need > 0 and heads:
            _, neg_age, c, gid, side = heapq.heappop(heads)
            q = queues[c]
            if not q or (q[-1] if side else q[0]) != gid:
                continue  # that end moved since: the other end of the class took it
            members = gblocks[gid]
            before = need
            while members and need > 0:
                b = members.pop()
                if last.get(b) == gid:
                    last[b] = ~gid
                    evicted.append(b)
                    need -= 1
            ages -= neg_age * (before - need)
            if members:
                break
            if side:
                del gblocks[q.pop()]
                while q and not gblocks[q[-1]]:
                    del gblocks[q.pop()]
            else:
                del gblocks[q.popleft()]
                while q and not gblocks[q[0]]:
                    del gblocks[q.popleft()]
            if q:
                g = q[-1] if side else q[0]
                age = now - gtime[g]
                heapq.heappush(heads, (dens[c][0 if age < base else min(int(age / base).bit_length(), lastbin)],
                                       -age, c, g, side))
            else:
                self._active.discard(c)
        self._size -= len(evicted)
        if evicted:
            self._evict_age += 0.05 * (ages / len(evicted) - self._evict_age)
        return evicted

    def discard(self, blocks: Sequence[int]) -> None:
        last = self._last
        for b in blocks:
            g = last.get(b)
            if g is not None and g >= 0:
                last[b] = ~g
                self._size -= 1

    def check_integrity(self) -> None:
        resident = [b for b, g in self._last.items() if g >= 0]
        assert len(resident) == self._size <= self.capacity, (len(resident), self._size, self.capacity)
        queued = {g for q in self._queues for g in q}
        for b in resident:
            g = self._last[b]
            assert g in queued and b in self._gblocks[g], f"resident block {b} is not queued"
        assert all(q or c not in self._active for c, q in enumerate(self._queues))
        assert all(c in self._active for c, q in enumerate(self._queues) if q)
