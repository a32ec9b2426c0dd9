"""How much of the LRU->Belady gap knowing *whether* or *when* could close, on every shared trace.

Two offline oracles bound what a better predictor could buy, each measured with
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

If `oracle-next` closes far more than `bayes`, knowing when a session returns is
what is missing; if even it stays low, the trace's reuse cannot be told apart
ahead of time at session granularity. Where `oracle-when` falls short of
`oracle-next`, the hazard machinery (bins, horizon) loses what the classes know.

    .venv/bin/python benchmarks/gap_headroom.py [--json] [--sharegpt-records 1000]
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import deque
from typing import Sequence

from hit_rate import traces

from kvcluster.policies.base import FAR, EvictionPolicy, RequestContext
from kvcluster.policies.bayes import BayesPolicy, _NT
from kvcluster.policies.lru import LRUPolicy
from kvcluster.policies.registry import POLICIES, register
from kvcluster.reuse_gap import GapModel
from kvcluster.simulator import PreparedTrace, TierPlan, prepare, replay
from kvcluster.traces import load_trace

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    parser.add_argument("--sharegpt-records", type=int, default=1000)
    parser.add_argument("--horizon-factor", type=float, default=None,
                        help="horizon of `bayes` and `oracle-when` (default: `bayes`'s own)")
    args = parser.parse_args()
    learnt = {"bayes", "oracle-when"}
    options = {} if args.horizon_factor is None else {"horizon_factor": args.horizon_factor}
    for oracle in (OracleWhether, OracleWhen, OracleNext):
        if oracle.name not in POLICIES:
            register(oracle)
    policies = ("lru", "bayes", "oracle-whether", "oracle-when", "oracle-next", "belady")
    rows = []
    for label, path, kwargs in traces(args.sharegpt_records):
        prepared = prepare(load_trace(path, **kwargs))
        OracleWhen.gaps = OracleNext.gaps = next_session_gaps(prepared)
        for frac in FRACTIONS:
            cap = max(1, round(frac * prepared.unique_blocks))
            rates = {p: replay(prepared, p, [TierPlan("hbm", cap)],
                               policy_options=options if p in learnt else None).hit_rate for p in policies}
            gap = rates["belady"] - rates["lru"]
            closed = {p: (rates[p] - rates["lru"]) / gap if gap > 0.005 else None for p in policies[1:5]}
            rows.append({"trace": label, "fraction": frac, "capacity_blocks": cap, "hit_rate": rates,
                         "gap_closed": closed})
            if not args.json:
                cells = " | ".join(f"{rates[p]:.4f}" for p in policies)
                shown = " | ".join("n/a" if c is None else f"{c:.0%}" for c in closed.values())
                print(f"| {label} | {frac:.0%} | {cap:,} | {cells} | {shown} |", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    if "--json" not in sys.argv:
        print("| trace | capacity | blocks | lru | bayes | oracle-whether | oracle-when | oracle-next | belady "
              "| gap closed: bayes | oracle-whether | oracle-when | oracle-next |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    sys.exit(main())
