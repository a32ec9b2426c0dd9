"""How much of the LRU->Belady gap knowing *whether*, *when* or *how fast* could close, on every shared trace.

Offline oracles bound what a better predictor could buy, each measured with
the same replay as the policies (prefix-token hit rate, one tier):

- `oracle-whether`: LRU that knows which blocks are never used again and evicts
  them first; a perfect "will it come back" predictor, with no idea of when.
- `oracle-when`: the `bayes` policy with its classes drawn from the true time
  until the session's next request (log-spaced: < 4 s, < 8 s, ... >= 256 s, never)
  instead of the features it learns from; the same machinery, fed a perfect
  "when" at session granularity.
- `oracle-next`: Belady over request groups: every block belongs to the request
  that used it last, and the group whose session comes back last gives up its
  blocks first, deepest first. What a perfect session-level "when" is worth to
  any policy, with no learning and no horizon in between.
- `oracle-pace`: the same, ranked by each session's pace instead of its next
  request: the mean time between the requests it has left (none: it goes
  first), not when the next of them comes. Where a session's requests arrive
  at random (a Poisson process at the session's own rate) the pace is the most
  any predictor can know of when it returns, so this is about the most an
  online policy could close there, given perfect foresight of how much more
  each conversation has to say and how fast.
- `oracle-informed` (ShareGPT and SWE-agent, timed by the loader's clock): `bayes`
  told whether each session comes back and the think-time distribution its next
  request is drawn from, not the draw (informed_oracle.py): about the most an
  online predictor could learn there.
- `fitted-online`: `bayes` with richer classes of what is known online (a
  session's first request: its prompt's and its answer's lengths; a later one:
  its turn, its session's pace so far and how its answer ended), each class's
  hazard a cure-rate exponential (P(the session comes back) x an exponential
  wait) fitted on the whole trace in advance. Not a policy (it learns from the
  future) but a generous bound for any learner of those features where a
  session's waits are memoryless; where they are not, the exponential fits
  badly and it bounds nothing.

If `oracle-next` closes far more than `bayes`, knowing when a session returns is
what is missing; if even it stays low, the trace's reuse cannot be told apart
ahead of time at session granularity. Where `oracle-when` falls short of
`oracle-next`, the hazard machinery (bins, horizon) loses what the classes know.
If `oracle-pace` too stays short of a goal, no online policy can reach it at
session granularity. A second table says how random each trace's waits are:
the median coefficient of variation of the gaps of sessions with six or more
requests, and how well the mean log of a session's gaps so far predicts its next.

Each trace is measured on its validation part (`--part`; kvcluster/traces/split.py), as hit_rate.py quotes it.

    .venv/bin/python benchmarks/gap_headroom.py [--json] [--part validation|tune|all] [--traces ...] [--sharegpt-records N]
        [--fixed-clock] [--clock-seed N] [--smoke]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections import deque
from typing import Sequence

import numpy as np
from hit_rate import REPORTED_PART, TRACES, UNTIMED, add_clock_options, clock_from, load_parts, traces
from informed_oracle import OracleInformed, sessions_returning, think_time_cdf

from kvcluster.policies.base import FAR, EvictionPolicy, RequestContext
from kvcluster.policies.bayes import BayesPolicy, _NT, answer_bucket, finish_index, session_bucket
from kvcluster.policies.lru import LRUPolicy
from kvcluster.policies.registry import POLICIES, register
from kvcluster.reuse_gap import GapModel
from kvcluster.hierarchy import TierPlan
from kvcluster.simulator import PreparedTrace, prepare, replay
from kvcluster.errors import TraceError
from kvcluster.traces.split import PART_NAMES

FRACTIONS = (0.02, 0.05, 0.10)
WHEN_EDGES_S = (4, 8, 16, 32, 64, 128, 256)


class OracleWhether(LRUPolicy):
    """LRU, except that blocks never used again are the first to go (admits and discards as LRU)."""

    name = "oracle-whether"
    offline = True

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        order = self._order
        dead = []
        for block, next_use in zip(blocks, ctx.next_use):
            order[block] = None
            order.move_to_end(block)
            if next_use >= FAR:
                dead.append(block)
        for block in reversed(dead):
            order.move_to_end(block, last=False)
        evicted = []
        while len(order) > self.capacity:
            evicted.append(order.popitem(last=False)[0])
        return evicted


def session_paces(trace: PreparedTrace) -> list[float | None]:
    """Per request, the mean seconds between its session's later requests: (time of the session's last
    request - this one's) / how many come after it (None: the session ends here)."""
    out: list[float | None] = [None] * trace.requests
    last_at: dict[str, float] = {}
    after: dict[str, int] = {}
    for i in range(trace.requests - 1, -1, -1):
        session = trace.sessions[i]
        n = after.get(session, 0)
        if n:
            out[i] = (last_at[session] - trace.arrivals[i]) / n
        else:
            last_at[session] = trace.arrivals[i]
        after[session] = n + 1
    return out


def next_session_gaps(trace: PreparedTrace) -> list[float | None]:
    """Per request, seconds until its session's next request (None: the session ends)."""
    out: list[float | None] = [None] * trace.requests
    following: dict[str, float] = {}
    for i in range(trace.requests - 1, -1, -1):
        session = trace.sessions[i]
        if session in following:
            out[i] = following[session] - trace.arrivals[i]
        following[session] = trace.arrivals[i]
    return out


class OracleWhen(BayesPolicy):
    """`bayes` whose class is the true bucket of the time to the session's next request."""

    name = "oracle-when"
    offline = True
    gaps: list[float | None] = []  # set per trace by `main`

    def __init__(self, capacity: int, **options) -> None:
        super().__init__(capacity, **options)
        buckets = len(WHEN_EDGES_S) + 2
        self._shared_class = buckets * _NT  # a shared prefix keeps a class of its own, as in `bayes`
        self.model = GapModel(buckets * _NT + 1, self.model.config)
        self._queues = [deque() for _ in range(buckets * _NT + 1)]
        self._hazards = self.model.all_hazards()
        self._dens = self.model.densities(self._lastbin, self._hazards)

    def _session_class(self, ctx: RequestContext, remember: bool) -> int:
        gap = self.gaps[ctx.index]
        bucket = len(WHEN_EDGES_S) + 1 if gap is None else sum(gap >= e for e in WHEN_EDGES_S)
        return bucket * _NT + ctx.transition


class OracleNext(EvictionPolicy):
    """Belady over request groups, from the true time of each session's next request."""

    name = "oracle-next"
    offline = True
    gaps: list[float | None] = []  # set per trace by `main`

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._last: dict[int, int] = {}  # resident block -> the group of its last use
        self._groups: dict[int, list[int]] = {}  # group -> blocks not yet popped, prefix first
        self._heap: list[tuple[float, int]] = []  # (-time its session returns, -group): the latest first
        self._next_group = 0

    def __contains__(self, block: int) -> bool:
        return block in self._last

    def __len__(self) -> int:
        return len(self._last)

    def resident(self):
        return list(self._last)

    def prefix_hits(self, blocks: Sequence[int]) -> int:
        n = 0
        for block in blocks:
            if block not in self._last:
                break
            n += 1
        return n

    def _group(self, blocks: Sequence[int], returns_at: float) -> list[int]:
        gid, self._next_group = self._next_group, self._next_group + 1
        members = []
        for block in blocks:
            if self._last.get(block) != gid:
                self._last[block] = gid
                members.append(block)
        self._groups[gid] = members
        heapq.heappush(self._heap, (-returns_at, -gid))
        return self._evict()

    def _evict(self) -> list[int]:
        evicted = []
        while len(self._last) > self.capacity:
            gid = -self._heap[0][1]
            members = self._groups[gid]
            while members and len(self._last) > self.capacity:
                block = members.pop()
                if self._last.get(block) == gid:
                    del self._last[block]
                    evicted.append(block)
            if not members:
                heapq.heappop(self._heap)
                del self._groups[gid]
        return evicted

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        gap = self.gaps[ctx.index]
        return self._group(blocks, float("inf") if gap is None else ctx.now + gap)

    def admit(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        """Demoted blocks: whose session they serve next is not known here, so they go first."""
        return self._group([b for b in blocks if b not in self._last], float("inf"))

    def discard(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._last.pop(block, None)

    def check_integrity(self) -> None:
        assert len(self._last) <= self.capacity
        for block, gid in self._last.items():
            assert block in self._groups[gid], f"resident block {block} is not in its group"


class OraclePace(OracleNext):
    """`oracle-next` ranked by the session's pace: the group whose session has the longest mean time between
    its remaining requests goes first (a session that ends, first of all), the newest first among equals.
    Arrivals at random keep no memory of how long a session has been away, so the rank does not change
    with age."""

    name = "oracle-pace"
    paces: list[float | None] = []  # set per trace by `main`

    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        pace = self.paces[ctx.index]
        return self._group(blocks, float("inf") if pace is None else pace)


def session_gap_stats(trace: PreparedTrace, min_requests: int = 6) -> dict:
    """How much a session's gaps between requests say of its next one: over sessions of `min_requests` or more,
    the median coefficient of variation of their gaps (1 for waits drawn at random at a steady rate, 0 for a
    fixed pace), and over every gap after a session's second, the correlation of its log with the mean log of
    the session's gaps before it (what an online policy can know of it)."""
    times: dict[str, list[float]] = {}
    for session, now in zip(trace.sessions, trace.arrivals):
        times.setdefault(session, []).append(now)
    cvs, known, next_log = [], [], []
    for arrivals in times.values():
        gaps = np.diff(arrivals)
        if len(arrivals) >= max(min_requests, 2) and gaps.mean() > 0:
            cvs.append(float(gaps.std() / gaps.mean()))
        logs = np.log(np.maximum(gaps, 0.1))
        for k in range(1, len(logs)):
            known.append(float(logs[:k].mean()))
            next_log.append(float(logs[k]))
    corr = float(np.corrcoef(known, next_log)[0, 1]) if len(known) > 2 and np.std(known) > 0 else None
    return {"sessions": len(cvs), "median_cv": float(np.median(cvs)) if cvs else None,
            "gaps": len(known), "corr_known_next": corr}


def online_classes(trace: PreparedTrace) -> list[int]:
    """Per request, a class of what an online policy knows when it is served: a session's first request by its
    prompt's length (< 1,024, < 4,096, < 16,384 tokens, longer) and its answer's (`answer_bucket`); a later one
    by its turn (2nd, 3rd-4th, 5th-8th, later), its session's pace so far (`session_bucket` of the geometric
    mean of its gaps) and how its answer ended (`finish_index`)."""
    out = []
    sessions: dict[str, tuple[float, float, int, int]] = {}  # session -> (last time, summed log gaps, gaps, turns)
    for i in range(trace.requests):
        session, now = trace.sessions[i], trace.arrivals[i]
        tokens = trace.output_tokens[i] if trace.output_tokens else 0
        seen = sessions.get(session)
        if seen is None:
            prompt = trace.input_tokens[i]
            size = 0 if prompt < 1024 else 1 if prompt < 4096 else 2 if prompt < 16384 else 3
            out.append(size * 4 + answer_bucket(tokens))
            sessions[session] = (now, 0.0, 0, 1)
            continue
        last, log_sum, gaps, turns = seen
        log_sum, gaps = log_sum + math.log(max(now - last, 0.25)), gaps + 1
        turn = 0 if turns < 2 else 1 if turns < 4 else 2 if turns < 8 else 3
        pace = session_bucket(math.exp(log_sum / gaps)) - 1
        finish = finish_index(trace.finishes[i] if trace.finishes else "", tokens)
        out.append(16 + (turn * 3 + pace) * 4 + finish)
        sessions[session] = (now, log_sum, gaps, turns + 1)
    return out


def fitted_cure_rates(classes: list[int], gaps: list[float | None]) -> dict[int, tuple[float, float]]:
    """Per class: (share of its requests whose session comes back, 1 / the mean wait of those that do)."""
    count: dict[int, list[float]] = {}
    for cls, gap in zip(classes, gaps):
        n = count.setdefault(cls, [0, 0, 0.0])
        n[0] += 1
        if gap is not None:
            n[1] += 1
            n[2] += gap
    return {c: (back / n, back / waited if waited > 0 else 1.0) for c, (n, back, waited) in count.items()}


class FittedOnline(BayesPolicy):
    """`bayes` with `online_classes`, each class's density its cure-rate hazard at the age bin's middle:
    P(back) e^(-rate age) rate / (P(back) e^(-rate age) + 1 - P(back)). A shared prefix keeps what `bayes`
    learns of it."""

    name = "fitted-online"
    offline = True
    classes: list[int] = []  # set per trace by `main`
    rates: dict[int, tuple[float, float]] = {}

    def _session_class(self, ctx: RequestContext, remember: bool) -> int:
        super()._session_class(ctx, remember)  # keeps the sessions `bayes` tracks
        return self.classes[ctx.index]

    def _refresh(self) -> None:
        super()._refresh()
        edges, last = self._edges, self._lastbin
        middles = [(edges[k] + edges[k + 1]) / 2 for k in range(last)] + [1.5 * edges[last]]
        dens = list(self._dens)
        for cls, (back, rate) in self.rates.items():
            row = []
            for age in middles:
                waiting = back * math.exp(-rate * age)
                row.append(waiting * rate / max(waiting + 1.0 - back, 1e-300))
            dens[cls] = row
        self._dens = dens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    parser.add_argument("--sharegpt-records", type=int, default=None, help="ShareGPT entries (default: all)")
    parser.add_argument("--part", choices=PART_NAMES, default=REPORTED_PART,
                        help=f"which part of each trace to measure (default {REPORTED_PART})")
    parser.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated, of {', '.join(TRACES)}")
    add_clock_options(parser)
    parser.add_argument("--horizon-factor", type=float, default=None,
                        help="horizon of `bayes`, `oracle-when` and `fitted-online` (default: `bayes`'s own)")
    parser.add_argument("--smoke", action="store_true", help="tiny slices of the traces: checks the code runs")
    args = parser.parse_args()
    if args.horizon_factor is not None and not args.horizon_factor > 0:
        parser.error(f"--horizon-factor must be > 0, got {args.horizon_factor}")
    chosen = args.traces.split(",")
    if any(t not in TRACES for t in chosen):
        parser.error(f"--traces: choose from {', '.join(TRACES)}, got {args.traces}")
    if not args.json:
        print("| trace | capacity | blocks | lru | bayes | oracle-whether | oracle-when | oracle-next | oracle-pace "
              "| fitted-online | oracle-informed | belady | gap closed: bayes | oracle-whether | oracle-when "
              "| oracle-next | oracle-pace | fitted-online | oracle-informed |")
        print("|---" * 19 + "|")
    options = {} if args.horizon_factor is None else {"horizon_factor": args.horizon_factor}
    for oracle in (OracleWhether, OracleWhen, OracleNext, OraclePace, FittedOnline, OracleInformed):
        if oracle.name not in POLICIES:
            register(oracle)
    rows, stats = [], {}
    clock = clock_from(args)
    for label, path, kwargs in traces(args.sharegpt_records, clock):
        if label not in chosen:
            continue
        try:
            [(_, trace)] = load_parts(path, (args.part,), args.smoke, **kwargs)
        except TraceError as err:
            print(f"gap_headroom: {err}", file=sys.stderr)
            return 2
        prepared = prepare(trace)
        stats[label] = session_gap_stats(prepared)
        rows += measure(label, prepared, clock if label in UNTIMED else None, options, args)
    if args.json:
        print(json.dumps(rows))
        return 0
    print("\n| trace | sessions of 6+ requests | median CV of their gaps | gaps after a 2nd | "
          "corr(mean log gap so far, log next gap) |")
    print("|---|---|---|---|---|")
    for label, st in stats.items():
        cv = "n/a" if st["median_cv"] is None else f"{st['median_cv']:.2f}"
        corr = "n/a" if st["corr_known_next"] is None else f"{st['corr_known_next']:.2f}"
        print(f"| {label} | {st['sessions']:,} | {cv} | {st['gaps']:,} | {corr} |")
    return 0


POLICIES_SHOWN = ("lru", "bayes", "oracle-whether", "oracle-when", "oracle-next", "oracle-pace", "fitted-online",
                  "oracle-informed", "belady")
LEARNT = {"bayes", "oracle-when", "fitted-online", "oracle-informed"}  # take `bayes`'s options


def measure(label: str, prepared: PreparedTrace, clock, options: dict, args: argparse.Namespace) -> list[dict]:
    """Rows of every policy and oracle on one trace at every fraction; `clock`: the clock that timed it (None:
    the trace's own times, where `oracle-informed` has no distribution to know and is left out)."""
    stats = session_gap_stats(prepared)
    OracleWhen.gaps = OracleNext.gaps = next_session_gaps(prepared)
    OraclePace.paces = session_paces(prepared)
    FittedOnline.classes = online_classes(prepared)
    FittedOnline.rates = fitted_cure_rates(FittedOnline.classes, OracleWhen.gaps)
    OracleInformed.returns = sessions_returning(prepared.sessions)
    if clock is not None:
        OracleInformed.cdf = staticmethod(think_time_cdf(clock))
    policies = [p for p in POLICIES_SHOWN if clock is not None or p != "oracle-informed"]
    rows = []
    for frac in FRACTIONS:
        cap = max(1, round(frac * prepared.unique_blocks))
        rates = {p: replay(prepared, p, [TierPlan("hbm", cap)],
                           policy_options=options if p in LEARNT else None).hit_rate for p in policies}
        gap = rates["belady"] - rates["lru"]
        closed = {p: (rates[p] - rates["lru"]) / gap if gap > 0.005 else None for p in policies[1:-1]}
        closed.setdefault("oracle-informed", None)
        rows.append({"trace": label, "part": args.part, "fraction": frac, "capacity_blocks": cap, "hit_rate": rates,
                     "gap_closed": closed, "session_gaps": stats})
        if not args.json:
            cells = " | ".join(f"{rates[p]:.4f}" if p in rates else "n/a" for p in POLICIES_SHOWN)
            shown = " | ".join("n/a" if c is None else f"{c:.0%}" for c in closed.values())
            print(f"| {label} | {frac:.0%} | {cap:,} | {cells} | {shown} |", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
