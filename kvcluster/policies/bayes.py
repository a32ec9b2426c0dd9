"""`bayes`: evict the request group of lowest hit density, from a learnt reuse-gap hazard per class.

Belady wins by knowing *when* a block comes back. This policy estimates it: the
blocks a request uses are classed by what is known once it is served, namely the
request's transition (first, append, fork, agent step), the geometric mean of its
session's gaps between requests so far (none yet, < 8 s, < 64 s, longer) and how its answer ended
when the serving side knows (a tool call, whose result comes back within seconds;
a long tool call, of LONG_TOOL_CALL_TOKENS or more, whose tool has more to do: on
the Claude Code traces the next request came a median 12 s after a call under 256
tokens, 18 s after one of 256-1,023 and 52 s after a longer one; the end of a turn,
which waits for a person; unknown). A session's first request
has no gaps to go by, so its class also holds the length of its answer: whether a
new conversation goes on at all depends on it (on the Mooncake trace two thirds of first
turns with answers under 32 tokens had a follow-up, 3-6% of those over 128). That is
the first request the policy sees of its session (each request that names none),
whatever its transition: on a
service whose conversations all start on one system prompt, each is a FORK of that
prompt, not a FIRST (the Mooncake trace with a 1,024-token prompt before every
request closed 2/1/1% of the gap with FIRSTs only, below ARC at 5 and 10%, and
2/4/11% so).
Later requests leave it out but for the long tool call: their session's gaps say more,
and splitting them all by length thinned the counts (ShareGPT and SWE-agent lost hit
rate). `GapModel` learns per class the hazard of reuse by age in doubling bins (Beta
posteriors pooled across classes, each request group one observation), counting
reuses of blocks that were evicted too, so what it learns does not depend on what
the cache kept. From it follows the LHD hit density (Beckmann et al., NSDI '18):
expected reuses per second of cache held, given the age, up to a horizon of
`horizon_factor` x how long a kept block lasts here: the mean age of recent
victims taken from a class's oldest end, or the cache's fill time (its capacity
over the mean rate blocks enter it: the age at which FIFO would evict) where that
is longer. A fresh group let go at once (the bypass below) says nothing of how
long blocks last; counted, its age of about 0 s pulled the horizon under one
conversation turn, which took the turn's return out of every density and made
the bypass run away (ShareGPT closed 71/87/85% of the gap with it counted,
98/98/98% without). The victims' ages remain the policy's own doing, so the same
loop can still close: on the ShareGPT conversations after the tuned ones, at 2%,
the horizon fell to 1-2 s for the last two thirds of the trace and `bayes` closed
32% of the gap. The fill time hardly depends on what the policy keeps; as a floor
it holds that run at 94%. The factor is 6 by default (mean gap closed over the
twelve shared-trace points with the other defaults: 62.4% at 4x, 62.7% at 6x,
62.2% at 8x).

All blocks of one request form a group, but for a leading run that other
sessions share (block type SYSTEM: a system prompt, or on hash-only traces a
prefix seen in another session), which forms a group of its own in the class
SHARED_PREFIX: its next use is any session's, not this one's next turn (on the
shared traces it took Claude Code from 55/43/49% of the gap to 64/52/54% and
SWE-agent from 48/78/81% to 67/79/86%, horizon 4x). The rest of the request is
tied to it: when the prefix is to leave, what follows it goes first, as it
cannot hit without it. Groups of a class queue in use order. Candidates are the oldest
group of every class (density falling with age: the class is done) and the
newest (density rising with age: the class comes back after a gap, so the
freshest is the one not worth its wait; this is the bypass Belady makes on
conversation traffic, where LRU thrashes). A group gives up its blocks deepest
first.

Why classes are per request (and its shared prefix) and not per block: a prefix
hit needs every block before it. Classing blocks by their own type or use count
split a request into groups that left at different times, often the prefix
first; on the shared traces that lost most of the gain (ShareGPT 2%: 0.064
against 0.173). With one class per request, a request's blocks leave deepest
first, so what remains of the group is always a prefix of it. Across requests it
can break: a prefix that a later request shared now belongs to that request's
group and may leave before the older request's own suffix (still in the older
group), which is then an orphan until its group's turn comes. Tracking parents
to prevent it would cost a dict per block; the per-request order already closes
98% of the gap on ShareGPT, where conversations own their blocks.

Where blocks are stored before the answer is known (vLLM's connector stores them as the engine computes
them), the answer is told after (`answered`) and the request's group moves to the class it would have had:
its counts move with it, exactly, while none of its blocks has been used again. Until then it is classed as
its session's last answer ended, and a session's first request, whose class hangs on its answer's length,
is no victim of its own store. Replayed in that order the shared traces close 7/10/14% (Mooncake),
63/58/57% (Claude Code), 98/98/98% (ShareGPT) and 69/77/88% (SWE-agent) of the gap, against 7/10/15,
68/62/58, 98/98/98 and 72/78/88% with the answer known at the store (RESULTS).

Cost: one dict write per block, one pass over the class ends per request that
evicts, O(log classes) per victim group, and every `refresh_requests` requests
the age-bin crossings since the last refresh counted and the density table
rebuilt in O(classes with counts x bins).

Memory, bounded for a cache that runs without end: the resident blocks; the
blocks that left, up to twice `ghost_factor` x capacity (at least `min_ghosts`),
whose returns still count as reuses at their true gap; the request groups, up to
twice what the last compaction kept (at least `min_groups`); and the sessions, and
the requests waiting for their answer, each up to `max_sessions`. Each bound is
checked at an eviction, a refresh or a request that waits for its answer, never per
block.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import Counter, deque
from typing import Sequence

from ..block_types import BlockType, TransitionType
from ..reuse_gap import GapModel, GapModelConfig, age_bin
from .base import EvictionPolicy, RequestContext
from .registry import register

_NT = len(TransitionType)
SESSION_BUCKETS = 4  # the session's typical gap between requests: none yet, < 8 s, < 64 s, longer
MAX_SESSIONS = 1 << 18  # sessions whose pace is remembered; beyond it the half idle longest is forgotten
GHOST_FACTOR = 16.0  # blocks that left are remembered up to this many times the capacity (their reuse still teaches)
MIN_GHOSTS = 1024  # and at least this many, so that a small cache still learns
MIN_GROUPS = 1 << 16  # request groups are compacted once twice what the last compaction kept, or twice this
FINISHES = ("unknown", "tool call", "end of turn", "long tool call")  # how the request's answer ended
_FINISH_OF = {"tool_use": 1, "tool_calls": 1, "end_turn": 2, "stop": 2}  # Anthropic and OpenAI names
_LONG_CALL = 3
LONG_TOOL_CALL_TOKENS = 512  # a tool call of at least this many tokens is a long one
ANSWER_LENGTHS = ("unknown", "< 32 tokens", "< 256 tokens", ">= 256 tokens")  # of a session's first answer
REQUEST_CLASSES = SESSION_BUCKETS * _NT * len(FINISHES) * len(ANSWER_LENGTHS)
SHARED_PREFIX = REQUEST_CLASSES  # the class of a request's leading blocks that other sessions share too
CLASSES = REQUEST_CLASSES + 1
_SYSTEM = int(BlockType.SYSTEM)
assert _SYSTEM == 0, "shared_lead counts leading zero bytes"


def session_bucket(gap_s: float | None) -> int:
    """Bucket of a session's typical gap between requests (None: this is its first)."""
    if gap_s is None:
        return 0
    return 1 if gap_s < 8.0 else (2 if gap_s < 64.0 else 3)


def finish_index(finish: str, output_tokens: int = 0) -> int:
    """Index in FINISHES of a finish reason as an API reports it (anything else: unknown), a tool call of
    `output_tokens` >= LONG_TOOL_CALL_TOKENS being a long one."""
    index = _FINISH_OF.get(finish, 0)
    return _LONG_CALL if index == 1 and output_tokens >= LONG_TOOL_CALL_TOKENS else index


def answer_bucket(output_tokens: int) -> int:
    """Index in ANSWER_LENGTHS of an answer of `output_tokens` tokens (0 or less: unknown)."""
    if output_tokens <= 0:
        return 0
    return 1 if output_tokens < 32 else (2 if output_tokens < 256 else 3)


def shared_lead(block_types: Sequence[int], n: int) -> int:
    """How many of a request's first `n` blocks, from the start, are typed SYSTEM: a prefix other sessions
    share (hash-only traces: seen in another session; traces with roles, and served chats: the system
    prompt). Their reuse waits for any session of that prefix, not for this one's next turn."""
    if len(block_types) == 0 or block_types[0] != _SYSTEM:
        return 0
    head = bytes(tuple(block_types[:n]))  # one byte per type (an array's buffer would give several), SYSTEM is 0
    return len(head) - len(head.lstrip(b"\0"))


def class_of(transition: int, session: int = 0, finish: int = 0, answer: int = 0) -> int:
    """Class index of a request's blocks (`session` from `session_bucket`, `finish` from `finish_index`,
    `answer` from `answer_bucket`, set for a session's first request only)."""
    return ((answer * len(FINISHES) + finish) * SESSION_BUCKETS + session) * _NT + transition


def describe_class(cls: int) -> dict:
    """The features a class index stands for."""
    if cls == SHARED_PREFIX:
        return {"shared_prefix": True}
    rest, tt = divmod(cls, _NT)
    rest, session = divmod(rest, SESSION_BUCKETS)
    answer, finish = divmod(rest, len(FINISHES))
    return {"transition": TransitionType(tt).name.lower(),
            "session_gap": ("first request", "< 8 s", "< 64 s", ">= 64 s")[session], "finish": FINISHES[finish],
            "first_answer": ANSWER_LENGTHS[answer]}


@register
class BayesPolicy(EvictionPolicy):
    """Hit-density eviction of request groups from a learnt per-class reuse-gap hazard."""

    name = "bayes"

    def __init__(self, capacity: int, gap_config: GapModelConfig | None = None, refresh_requests: int = 32,
                 horizon_factor: float = 6.0, max_sessions: int = MAX_SESSIONS,
                 ghost_factor: float = GHOST_FACTOR, min_ghosts: int = MIN_GHOSTS, min_groups: int = MIN_GROUPS
                 ) -> None:
        super().__init__(capacity)
        if refresh_requests < 1 or horizon_factor <= 0 or max_sessions < 1 or not ghost_factor >= 0 or min_ghosts < 0 \
                or min_groups < 0:
            raise ValueError("refresh_requests and max_sessions must be >= 1, horizon_factor > 0, ghost_factor, "
                             "min_ghosts and min_groups >= 0")
        self._max_sessions = max_sessions
        kept = min(ghost_factor * capacity, 1 << 62) if capacity else 0  # an empty cache keeps only min_ghosts
        self._ghosts_kept = max(int(kept), min_ghosts)  # after each sweep
        self._min_groups = self._groups_kept = min_groups  # groups are compacted at twice what the last one kept
        self.model = GapModel(CLASSES, gap_config)
        self._base, self._lastbin = self.model.base, self.model.config.bins - 1
        self._edges = self.model.edges
        self._refresh_every = refresh_requests
        self._horizon_factor = horizon_factor
        self._last: dict[int, int] = {}  # block -> group of its last use; ~group when not resident
        self._gtime: list[float] = []  # per group: time of use
        self._gcls: list[int] = []  # per group: class
        self._galive: list[int] = []  # per group: blocks whose last use it still is (for the hazard)
        self._gtaken: list[int] = []  # per group: blocks it let go of (evicted, or discarded to another tier)
        self._gblocks: dict[int, list[int]] = {}  # queued group -> blocks not yet popped, prefix first
        self._queues: list[deque[int]] = [deque() for _ in range(CLASSES)]
        self._active: set[int] = set()  # classes with a non-empty queue
        self._crossed = [0] * self.model.config.bins  # per age bin k: the groups before it are done with bin k
        self._size = 0
        self._requests = 0
        self._evict_age = 0.0  # EMA of the ages of victims from a class's oldest end: how long a block lasts here
        self._entered = 0  # blocks that entered the cache (uses that missed, and admissions)
        self._start: float | None = None  # time of the first request
        self._hazards = self.model.all_hazards()  # as of the last refresh
        self._dens = self.model.densities(self._lastbin, self._hazards)
        self._sessions: dict[str, tuple[float, int, float, int, int]] = {}  # session -> (last request time, gap
        #   bucket, summed log gaps, gaps counted, how its last known answer ended: a FINISHES index)
        self._due = float("inf")  # when the next group reaches a new age bin
        self._clock = float("-inf")  # the latest request time seen: crossings up to it count
        self._gnext: list[int] = []  # per group: the next age bin it is to be counted in
        self._ends: dict[int, tuple[tuple, float]] = {}  # eviction candidates kept while their age bin holds
        self._tails: dict[int, int] = {}  # group of a shared prefix -> the group of the rest of its request
        self._arrived: set[int] = set()  # groups admitted with no use known here: their first use is no reuse
        self._unanswered: dict[str, tuple[list[int], bool]] = {}  # session -> (groups, whether its first request)
        #   of its latest request stored before its answer was known (`answered`)
        self._shared_class = SHARED_PREFIX

    @property
    def fill_time_s(self) -> float:
        """How long the cache takes to fill at the mean rate blocks have entered it since the first request: the
        age at which FIFO would evict (0 before any has entered)."""
        if not self._entered or self._start is None:
            return 0.0
        return self.capacity * (self._clock - self._start) / self._entered

    @property
    def horizon_s(self) -> float:
        """How far ahead the densities count reuses: `horizon_factor` x the mean age of the victims taken from a
        class's oldest end (how long a kept block lasts here), or x the fill time where that is longer."""
        fill = self.fill_time_s
        return (self._evict_age if self._evict_age > fill else fill) * self._horizon_factor

    @property
    def sessions_known(self) -> int:
        return len(self._sessions)

    def remembers(self, block: int) -> bool:
        return block in self._last

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

    def _count_crossings(self) -> None:
        """Count the blocks of every group that reached a new age bin unused by the clock.

        Deferred to the next refresh, the only reader of the counts: a group whose
        blocks are reused or leave before then settles the bins it crossed with them
        at once (`_settle`), so the counts come out as if taken at every crossing."""
        now = self._clock
        if now < self._due:
            return
        edges, crossed, gtime, galive, gcls = self._edges, self._crossed, self._gtime, self._galive, self._gcls
        gnext = self._gnext
        reached = self.model.reached
        due = float("inf")
        limit = len(gtime)
        for k in range(1, self._lastbin + 1):  # bin k only looks at the groups bin k - 1 is done with
            g = crossed[k]
            edge = edges[k]
            while g < limit:
                t = gtime[g] + edge
                if t > now:
                    if t < due:
                        due = t
                    break
                if gnext[g] == k:  # counted at every bin before k, and alive then
                    alive = galive[g]
                    if alive > 0:
                        reached[gcls[g]][k] += alive
                        gnext[g] = k + 1
                g += 1
            crossed[k] = limit = g
        self._due = due

    def _settle(self, g: int, n: int) -> None:
        """Count `n` blocks of group `g` that leave it now (reused, or admitted into another group) in the age
        bins the group crossed since crossings were last counted: they were unused then."""
        k, t, edges, clock = self._gnext[g], self._gtime[g], self._edges, self._clock
        if k <= self._lastbin and t + edges[k] <= clock:
            row = self.model.reached[self._gcls[g]]
            last = self._lastbin
            while k <= last and t + edges[k] <= clock:
                row[k] += n
                k += 1

    def _refresh(self) -> None:
        if len(self._gtime) > 2 * self._groups_kept:
            self._compact_groups()
        self._count_crossings()
        horizon = age_bin(self.horizon_s, self._base, self._lastbin)
        self._hazards, self._dens = self.model.hazards_and_densities(horizon)
        self._ends.clear()

    def _session_class(self, ctx: RequestContext, remember: bool) -> int:
        """Class of the request's blocks but its shared prefix: transition, the geometric mean of the session's
        gaps between requests so far and how its answer ended.

        The geometric mean and not the last gap: one gap is a noisy draw of the session's pace, and the
        mean of all of them keeps a session in one class while its pace holds (it closed more of the gap to
        Belady at 11 of 12 points no default was tuned on, see RESULTS). A live cache meets sessions without
        end, so past `max_sessions` it forgets the half idle longest; one forgotten comes back as a first
        request.

        A request stored before its answer is known (`answered` tells it later) is classed as its session's
        last known answer ended until then: an agent's tool calls come in runs (Claude Code replayed with each
        answer told after its store closed 64/55/54% of the gap classed as unknown, 63/58/57% so)."""
        sessions = self._sessions
        seen = sessions.get(ctx.session)
        finish = finish_index(ctx.finish, ctx.output_tokens)
        if seen is None:
            sb, log_sum, gaps, told = 0, 0.0, 0, 0
        else:
            last_time, sb, log_sum, gaps, told = seen
            gap = ctx.now - last_time
            if gap >= 0.5 * self._base:  # a shorter one is the same burst: it keeps the bucket it had
                log_sum, gaps = log_sum + math.log(gap), gaps + 1
                sb = session_bucket(math.exp(log_sum / gaps))
            if not finish and ctx.output_tokens <= 0:  # its answer is not known (yet): as the last one ended
                finish = told
        if remember and ctx.session:
            sessions[ctx.session] = (ctx.now, sb, log_sum, gaps, finish)
            if len(sessions) > self._max_sessions:
                self._forget_sessions()
        answer = answer_bucket(ctx.output_tokens) if seen is None else 0  # the session's first request
        return class_of(ctx.transition, sb, finish, answer)

    def predict_within(self, blocks: Sequence[int], ctx: RequestContext, horizon_s: float) -> list[float]:
        """P(each block is used again within `horizon_s` of this request), before `access` sees it.

        Read-only: the classes `access` would give the blocks and the posterior
        hazards as of the last refresh (for calibration against the trace)."""
        n = len(blocks)
        if not n:
            return []
        cls = self._session_class(ctx, remember=False)
        lead = shared_lead(ctx.block_types, n)
        p_own = self.model.p_reuse_within(cls, 0.0, horizon_s, self._hazards[cls])
        if not lead:
            return [p_own] * n
        shared = self._shared_class
        p_shared = self.model.p_reuse_within(shared, 0.0, horizon_s, self._hazards[shared])
        return [p_shared] * lead + [p_own] * (n - lead)

    # -- the policy -------------------------------------------------------------------------------

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        now = ctx.now
        if now > self._clock:
            self._clock = now
        if self._start is None:
            self._start = now
        self._requests += 1
        r = self._requests
        if r % self._refresh_every == 1 or self._refresh_every == 1 or (r < self._refresh_every and not r & (r - 1)):
            self._refresh()  # also at requests 2, 4, 8, ...: the first counts matter most
        n = len(blocks)
        if not n:
            return []
        waiting = self._unanswered.get(ctx.session) if ctx.continues else None
        if waiting is not None:  # more blocks of a request whose answer is awaited: its class, its groups
            first, cls = waiting[1], self._gcls[waiting[0][0]]
        else:
            first = ctx.session not in self._sessions  # its session's first request (or it names none)
            cls = self._session_class(ctx, remember=not ctx.continues)
        last, gtime, gcls, galive = self._last, self._gtime, self._gcls, self._galive
        reused, settle = self.model.reused, self._settle
        base, lastbin = self._base, self._lastbin
        lead = shared_lead(ctx.block_types, n)
        start = len(gtime)
        if lead:  # group `start` takes the shared prefix, `start + 1` the rest of the request
            segments = ((start, self._shared_class, blocks[:lead]), (start + 1, cls, blocks[lead:]))
        else:
            segments = ((start, cls, blocks),)
        run_old, run_n = -1, 0
        new = 0
        get = last.get
        gnext, reached, groups, gblocks = self._gnext, self.model.reached, self.model.groups, self._gblocks
        gtaken = self._gtaken
        queues, active, arrived = self._queues, self._active, self._arrived
        for gid, gclass, part in segments:
            members: list[int] = []
            add = members.append
            for b in part:
                old = get(b)
                if old is None:
                    new += 1
                else:
                    if old < 0:
                        old = ~old
                        new += 1
                    if old >= start:  # repeated within this request
                        continue
                    if old != run_old:
                        if run_n:
                            if run_old not in arrived:
                                gap = now - gtime[run_old]
                                k = 0 if gap < base else min(int(gap / base).bit_length(), lastbin)
                                reused[gcls[run_old]][k] += run_n
                            settle(run_old, run_n)
                            galive[run_old] -= run_n
                        run_old, run_n = old, 0
                    run_n += 1
                last[b] = gid
                add(b)
            m = len(members)  # never 0 for the first segment: a request's first block is no repeat
            gtime.append(now)
            gcls.append(gclass)
            galive.append(m)
            gtaken.append(0)
            gnext.append(1)
            if m:
                reached[gclass][0] += m
                groups[gclass] += 1
                gblocks[gid] = members
                queues[gclass].append(gid)
                active.add(gclass)
                if gid != start:
                    self._tails[start] = gid
        if run_n:
            if run_old not in arrived:
                gap = now - gtime[run_old]
                reused[gcls[run_old]][0 if gap < base else min(int(gap / base).bit_length(), lastbin)] += run_n
            settle(run_old, run_n)
            galive[run_old] -= run_n
        due = now + self._edges[1]
        if due < self._due:
            self._due = due
        self._size += new
        self._entered += new
        if not ctx.finish and ctx.output_tokens <= 0 and ctx.session:  # its answer may be told later
            own = start + 1 if lead else start
            self._await_answer(ctx.session, own, first, waiting)
            if self._size > self.capacity and first and waiting is None:
                return self._evict_sparing(own, now)
        return self._evict(now) if self._size > self.capacity else []

    def _evict_sparing(self, gid: int, now: float) -> list[int]:
        """`_evict`, but for group `gid` of the request being stored while its answer is pending: it goes
        only if nothing else can. Ranked now, in the class of an unknown answer, it would be taken for the
        newest group of that class, so the bypass would drop the blocks of every request whose answer
        turns out to bring its session back (on the vLLM connector's path, where each request's answer is
        told after its blocks are stored)."""
        cls = self._gcls[gid]
        queue = self._queues[cls]
        if not queue or queue[-1] != gid:
            return self._evict(now)
        queue.pop()
        if not queue:
            self._active.discard(cls)
        evicted = self._evict(now)
        queue.append(gid)
        self._active.add(cls)
        if self._size > self.capacity:
            evicted += self._evict(now)
        return evicted

    def _await_answer(self, session: str, gid: int, first: bool, more_of: tuple[list[int], bool] | None) -> None:
        """Remember group `gid` as (more of, with `more_of`) `session`'s latest request, whose answer `answered`
        may tell."""
        if gid not in self._gblocks:  # it holds no blocks of its own (only a shared prefix, or repeats)
            return
        if more_of is not None:
            more_of[0].append(gid)
            return
        waiting = self._unanswered
        waiting.pop(session, None)  # re-entered last: the dict's order is the order of the requests
        waiting[session] = ([gid], first)
        if len(waiting) > self._max_sessions:  # answers that never came: the older half is given up
            for stale in list(waiting)[:len(waiting) // 2]:
                del waiting[stale]

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        """The answer to `session`'s latest request ended so, after its blocks were stored (vLLM's connector
        stores a request's blocks as the engine computes them, before the request finishes).

        Its group moves to the class `access` would have given it had the answer been known (its groups, where
        it was stored in parts: `RequestContext.continues`): its class's counts move with it and it joins the
        new class's queue in the order groups entered. Exact as long as none of its blocks has been used again
        or let go since; otherwise it keeps the class it has (its counts are spread over bins and groups by
        then). A session's shared prefix is classed by no answer."""
        due = self._unanswered.pop(session, None)
        told = finish_index(finish, output_tokens)
        if due is None or not told and output_tokens <= 0:  # nothing waits, or nothing is told
            return
        seen = self._sessions.get(session)
        if seen is not None:
            self._sessions[session] = seen[:4] + (told,)
        groups, first = due
        for gid in groups:
            self._reclass(gid, told, answer_bucket(output_tokens) if first else 0)

    def _reclass(self, gid: int, finish: int, answer: int) -> None:
        """Move group `gid` to the class of its transition and session gap with `finish` and `answer`."""
        members = self._gblocks.get(gid)  # None once every block of it left (it is no longer queued)
        if self._galive[gid] != (len(members) if members is not None else 0) + self._gtaken[gid]:
            return  # a block of it was used again, discarded or forgotten since
        old = self._gcls[gid]
        rest, transition = divmod(old, _NT)
        session_gap = rest % SESSION_BUCKETS
        new = class_of(transition, session_gap, finish, answer)
        if new == old:
            return
        alive, reached, groups = self._galive[gid], self.model.reached, self.model.groups
        for k in range(self._gnext[gid]):  # the bins it was counted in (bin 0 when stored)
            reached[old][k] -= alive
            reached[new][k] += alive
        groups[old] -= 1
        groups[new] += 1
        self._gcls[gid] = new
        if members is None:
            return
        queue = self._queues[old]
        at = len(queue) - 1  # it was stored lately: look for it from the newest end, not through the class
        while queue[at] != gid:
            at -= 1
        del queue[at]
        if not queue:
            self._active.discard(old)
        queue = self._queues[new]  # in the order the groups entered (their numbers)
        at = len(queue)
        while at and queue[at - 1] > gid:
            at -= 1
        queue.insert(at, gid)
        self._active.add(new)

    def admit(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        """Demoted blocks keep the class and last-use time they had above; no use is counted. A block with no
        use known here (read from another node, adopted from files, a ghost forgotten) arrives now, and its
        first use is not a reuse: its gap would be the time since it arrived, not since it was last used."""
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
                self._settle(old, len(members))
                self._galive[old] -= len(members)
                if old in self._arrived:  # left and came back unused: still no use known here
                    self._arrived.add(gid)
            else:
                self._arrived.add(gid)
                gtime.append(ctx.now)
                cls = class_of(ctx.transition)
                self.model.note_reuse_row(cls)
            gcls.append(cls)
            self._galive.append(len(members))
            self._gtaken.append(0)
            self._gnext.append(self._lastbin + 1)  # never counted at a crossing: its blocks count nowhere
            for b in members:
                last[b] = gid
            self._gblocks[gid] = members
            self._queues[cls].append(gid)
            self._active.add(cls)
            self._size += len(members)
            self._entered += len(members)
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
        memo = self._ends  # (class, side) -> the candidate as computed, and until when its age bin holds
        edges = self._edges
        for c in self._active:  # an active class has a queued group (one emptied by `_drop_tail` goes when reached)
            q = queues[c]
            key = c + c
            for g in ((q[0], q[-1]) if len(q) > 1 else (q[0],)):
                hit = memo.get(key)
                if hit is not None and hit[0][3] == g and now < hit[1]:
                    heads.append(hit[0])
                else:
                    t = gtime[g]
                    age = now - t
                    k = 0 if age < base else min(int(age / base).bit_length(), lastbin)
                    cand = (dens[c][k], t, c, g, key - c - c)
                    memo[key] = (cand, t + edges[k + 1] if k < lastbin else float("inf"))
                    heads.append(cand)
                key += 1
        heapq.heapify(heads)
        evicted: list[int] = []
        get, add, extend = last.get, evicted.append, evicted.extend
        galive, taken = self._galive, self._gtaken
        tails, shared_class = self._tails, self._shared_class
        ages, aged = 0.0, 0  # summed ages and count of the victims from a class's oldest end
        while need > 0 and heads:
            _, t, c, gid, side = heapq.heappop(heads)
            q = queues[c]
            if not q or (q[-1] if side else q[0]) != gid:
                continue  # that end moved since: the other end of the class took it
            members = gblocks[gid]
            if c == shared_class and gid in tails:
                while members and get(members[-1]) != gid:  # used again since: not this group's to evict
                    members.pop()
                if members:  # the prefix is about to break: the rest of its request goes first
                    before = need
                    need, tail_ages = self._drop_tail(gid, need, evicted, now)
                    if not side:
                        ages += tail_ages
                        aged += before - need
                    if need <= 0:
                        break
                else:  # its blocks all moved on: the group goes, its tail is no longer tied to it
                    del tails[gid]
            before = need
            gone = ~gid
            if galive[gid] == len(members) + taken[gid]:  # every block left is resident and last used here
                k = need if need < len(members) else len(members)
                chunk = members[-k:]
                del members[-k:]
                for b in chunk:
                    last[b] = gone
                chunk.reverse()
                extend(chunk)
                need -= k
            else:
                pop = members.pop
                while members and need > 0:
                    b = pop()
                    if get(b) == gid:
                        last[b] = gone
                        add(b)
                        need -= 1
            taken[gid] += before - need
            if not side:
                ages += (now - t) * (before - need)
                aged += before - need
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
                                       gtime[g], c, g, side))
            else:
                self._active.discard(c)
        self._size -= len(evicted)
        if len(last) - self._size > 2 * self._ghosts_kept:
            self._forget_ghosts()
        if aged:  # how long a kept block lasts: a fresh group let go at once says nothing of it
            self._evict_age += 0.05 * (ages / aged - self._evict_age)
        return evicted

    def _drop_tail(self, shared: int, need: int, evicted: list[int], now: float) -> tuple[int, float]:
        """Evict, deepest first, what is left of the request whose shared prefix (group `shared`) is to leave
        now: it cannot hit without that prefix. Returns what is still needed beyond it and the victims' summed
        ages. An emptied group stays queued until its class's eviction reaches it; one that is not stays tied to
        the prefix."""
        tail = self._tails.pop(shared)
        members = self._gblocks.get(tail)
        if not members:  # it left already
            return need, 0.0
        last, gone, before = self._last, ~tail, need
        while members and need > 0:
            b = members.pop()
            if last.get(b) == tail:
                last[b] = gone
                evicted.append(b)
                need -= 1
        self._gtaken[tail] += before - need
        if members:
            self._tails[shared] = tail
        return need, (now - self._gtime[tail]) * (before - need)

    # -- bounded memory ---------------------------------------------------------------------------

    def _forget_sessions(self) -> None:
        """Keep the half of the sessions seen last (by their last request): amortized O(log) per session."""
        keep = sorted(self._sessions.items(), key=lambda item: item[1][0])[len(self._sessions) // 2:]
        self._sessions = dict(keep)

    def _forget_ghosts(self) -> None:
        """Forget the blocks that left longest ago, keeping `ghosts_kept`.

        A block that left is remembered (its group, as ~group) so that its return
        still counts as a reuse at its true gap. A live cache meets blocks without
        end, so once the ghosts reach twice `ghosts_kept` the oldest go, by the order
        of their groups (their last use). A forgotten block leaves its group's count
        of blocks at risk as a censored observation: the age bins it crossed count
        it, later ones do not, and if it comes back it is new. Amortized O(1) per
        block that left (the groups it leaves empty go at the next compaction)."""
        last = self._last
        per_group = Counter(last.values())  # ghosts under ~group (< 0), resident blocks under their group
        ghosts = sorted(g for g in per_group if g < 0)  # newest group first (ints only: no garbage to collect)
        excess = len(last) - self._size - self._ghosts_kept
        if excess <= 0:
            return
        galive, settle = self._galive, self._settle
        while excess > 0:  # from the oldest group on (~g = -1 is group 0)
            g = ghosts.pop()
            n = per_group[g]
            settle(~g, n)
            galive[~g] -= n
            excess -= n
        cut = ghosts[-1] if ghosts else ~len(galive)  # ghosts at or under it (as newer) stay
        for b in [b for b, g in last.items() if cut < g < 0]:
            del last[b]

    def _compact_groups(self) -> None:
        """Drop the groups no block's last use is any more, and renumber the rest in order.

        Run once the groups are twice what the last compaction kept, so O(1) per
        request amortized; without it a cache that holds its whole working set
        would keep a group, and its list of blocks, for every request it served.
        A dropped group still queued holds no block whose last use it is, so its
        class's eviction would have taken nothing from it, and a shared prefix
        with none left no longer ties its tail; at a class's end, though, its age
        stood for the class until eviction reached it, so dropping it can change
        which class goes first. Renumbering in order changes no decision (a
        group's number only orders it). At the default floor of 65,536 groups no
        replay of the shared traces compacts."""
        galive, gblocks, tails = self._galive, self._gblocks, self._tails
        keep = [g for g, alive in enumerate(galive) if alive > 0]
        new = [-1] * len(galive)
        for i, g in enumerate(keep):
            new[g] = i
        last = self._last
        for b, g in last.items():  # values only: the dict's size holds
            last[b] = new[g] if g >= 0 else ~new[~g]
        self._gtime = [self._gtime[g] for g in keep]
        self._gcls = [self._gcls[g] for g in keep]
        self._galive = [galive[g] for g in keep]
        self._gtaken = [self._gtaken[g] for g in keep]
        self._gnext = [self._gnext[g] for g in keep]
        self._gblocks = {new[g]: members for g, members in gblocks.items() if new[g] >= 0}
        self._tails = {new[g]: new[t] for g, t in tails.items() if new[g] >= 0 and new[t] >= 0}
        self._arrived = {new[g] for g in self._arrived if new[g] >= 0}
        self._unanswered = {s: (kept, first) for s, (gids, first) in self._unanswered.items()
                            if (kept := [new[g] for g in gids if new[g] >= 0])}
        self._queues = [deque(new[g] for g in q if new[g] >= 0) for q in self._queues]
        self._active = {c for c, q in enumerate(self._queues) if q}
        self._crossed = [bisect_left(keep, g) for g in self._crossed]
        self._ends.clear()
        self._groups_kept = max(len(keep), self._min_groups)

    @property
    def groups_tracked(self) -> int:
        """Request groups the policy keeps (resident blocks' and remembered ghosts')."""
        return len(self._gtime)

    def discard(self, blocks: Sequence[int]) -> None:
        last, taken = self._last, self._gtaken
        for b in blocks:
            g = last.get(b)
            if g is not None and g >= 0:
                last[b] = ~g
                taken[g] += 1
                self._size -= 1
        if len(last) - self._size > 2 * self._ghosts_kept:
            self._forget_ghosts()

    def check_integrity(self) -> None:
        assert all(0 <= g < len(self._gtime) for g in self._arrived)
        assert all(0 <= g < len(self._gtime) for gids, _ in self._unanswered.values() for g in gids)
        resident = [b for b, g in self._last.items() if g >= 0]
        assert len(resident) == self._size <= self.capacity, (len(resident), self._size, self.capacity)
        queued = {g for q in self._queues for g in q}
        for b in resident:
            g = self._last[b]
            assert g in queued and b in self._gblocks[g], f"resident block {b} is not queued"
        assert all(q or c not in self._active for c, q in enumerate(self._queues))
        assert all(c in self._active for c, q in enumerate(self._queues) if q)
        assert all(g in queued for g in self._tails), "a shared prefix that left is still tied to a tail"
        galive = self._galive
        assert all(galive[g if g >= 0 else ~g] > 0 for g in self._last.values()), "a block's group counts it not"
        for g, members in self._gblocks.items():  # eviction's fast path: equality means every member is live
            assert galive[g] <= len(members) + self._gtaken[g], f"group {g} counts more than it can hold"
            if galive[g] == len(members) + self._gtaken[g]:
                assert all(self._last.get(b) == g for b in members), f"group {g} holds a block it let go of"
        crossed = self._crossed[1:]
        assert all(a >= b for a, b in zip(crossed, crossed[1:])) and crossed[0] <= len(self._gtime)
        assert len(self._last) - self._size <= 2 * self._ghosts_kept, "ghosts beyond their bound"
