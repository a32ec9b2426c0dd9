"""Trace replay: the policy engine against capacity-only tiers and a cost model.

Hit rate is the prefix-token hit rate: over all requests, the blocks of each
request's leading resident run divided by all referenced blocks, where every
block of a request is resident right after it is served. The same Hierarchy
and policies run in the live system.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from .block_types import BlockType
from .cost_model import CostModel
from .hierarchy import Hierarchy, TierPlan, build_hierarchy
from .policies.base import FAR, RequestContext
from .policies.registry import POLICIES
from .predictor import PredictorConfig, ReusePredictor
from .prefetch import Prefetcher
from .pricing import cost_per_million_prompt_tokens
from .traces.base import Trace


@dataclass(frozen=True)
class PreparedTrace:
    """A trace with keys interned to dense ints, ready for fast replays."""

    name: str
    block_size: int
    blocks: tuple[tuple[int, ...], ...]
    types: tuple[tuple[int, ...], ...]
    transitions: tuple[int, ...]
    arrivals: tuple[float, ...]
    input_tokens: tuple[int, ...]
    sessions: tuple[str, ...]
    unique_blocks: int
    finishes: tuple[str, ...] = ()  # how each request's generation ended ("" unknown); empty: none known
    output_tokens: tuple[int, ...] = ()  # tokens each request generated (0 unknown); empty: none known

    @property
    def requests(self) -> int:
        return len(self.blocks)

    @property
    def block_refs(self) -> int:
        return sum(len(b) for b in self.blocks)

    def infinite_hit_rate(self) -> float:
        """Prefix hit rate of a cache that never evicts."""
        seen: set[int] = set()
        hits = 0
        for blocks in self.blocks:
            for block in blocks:
                if block not in seen:
                    break
                hits += 1
            seen.update(blocks)
        return hits / max(1, self.block_refs)

    def next_uses(self) -> list[list[int]]:
        """For every reference, the index of the next request that uses the block (FAR if none)."""
        last: dict[int, int] = {}
        out: list[list[int]] = [[] for _ in self.blocks]
        for i in range(len(self.blocks) - 1, -1, -1):
            out[i] = [last.get(b, FAR) for b in self.blocks[i]]
            for b in self.blocks[i]:
                last[b] = i
        return out


def request_context(trace: PreparedTrace, i: int, next_use: Sequence[int] | None = None,
                    future: dict[int, int] | None = None, answer: bool = True) -> RequestContext:
    """What a policy knows when request `i` arrives; the live replay builds the same. Without `answer`, how
    its answer ended is left out (told after the request is served: `replay(..., answers_at_finish=True)`)."""
    return RequestContext(index=i, now=trace.arrivals[i], block_types=trace.types[i],
                          transition=trace.transitions[i], next_use=next_use, session=trace.sessions[i],
                          future=future, finish=trace.finishes[i] if trace.finishes and answer else "",
                          output_tokens=trace.output_tokens[i] if trace.output_tokens and answer else 0)


def prepare(trace: Trace) -> PreparedTrace:
    ids: dict[bytes, int] = {}
    blocks = tuple(tuple(ids.setdefault(k, len(ids)) for k in r.block_keys) for r in trace.requests)
    return PreparedTrace(
        name=trace.name,
        block_size=trace.block_size,
        blocks=blocks,
        types=tuple(tuple(int(t) for t in r.block_types) for r in trace.requests),
        transitions=tuple(int(r.transition) for r in trace.requests),
        arrivals=tuple(float(r.arrival_s) for r in trace.requests),
        input_tokens=tuple(int(r.input_tokens) for r in trace.requests),
        sessions=tuple(r.session for r in trace.requests),
        unique_blocks=len(ids),
        finishes=tuple(r.finish for r in trace.requests) if any(r.finish for r in trace.requests) else (),
        output_tokens=tuple(int(r.output_tokens) for r in trace.requests),
    )


@dataclass
class ReplayResult:
    policy: str
    capacity_blocks: int  # summed over tiers
    tiers: list[dict]  # name, capacity_blocks, hits, hit_rate
    hit_rate: float
    block_refs: int
    prefix_hits: int
    evictions: int
    seconds: float
    partial_hit_rate: float = 0.0  # blocks in the prefix run with some head shards recomputed
    projected_ttft_s: dict | None = None
    throughput: dict | None = None
    cost: dict | None = None  # USD per hour and per million prompt tokens (a priced node; see pricing.py)
    prefetch: dict | None = None
    predictor: list[dict] | None = None
    lookahead: dict | None = None  # the same replay with queue look-ahead: {"lookahead_s", "hit_rate"}

    @property
    def refs_per_s(self) -> float:
        return self.block_refs / max(self.seconds, 1e-9)

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        out["refs_per_s"] = round(self.refs_per_s)
        out["per_tier"] = {t["name"]: t["hit_rate"] for t in self.tiers}
        return out


def shard_trace(trace: PreparedTrace, heads: int) -> PreparedTrace:
    """The same trace with every block split into `heads` consecutive shard ids."""
    return replace(
        trace,
        blocks=tuple(tuple(b * heads + h for b in blocks for h in range(heads)) for blocks in trace.blocks),
        types=tuple(tuple(t for t in types for _ in range(heads)) for types in trace.types),
        unique_blocks=trace.unique_blocks * heads,
    )


def shard_prefix(hierarchy: Hierarchy, shards: Sequence[int], heads: int) -> tuple[list[int], int]:
    """Block-level prefix run over shards: (full blocks per slowest tier, partial blocks).

    A block continues the run if any shard survives; its missing shards are
    recomputed. The run ends at the first block with no shard anywhere.
    """
    per_tier = [0] * len(hierarchy.policies)
    partial = 0
    for start in range(0, len(shards), heads):
        tiers = [hierarchy.locate(s) for s in shards[start : start + heads]]
        present = [t for t in tiers if t is not None]
        if not present:
            break
        if len(present) == heads:
            per_tier[max(present)] += 1
        else:
            partial += 1
    return per_tier, partial


def replay(
    trace: PreparedTrace,
    policy: str,
    plan: Sequence[TierPlan],
    *,
    cost: CostModel | None = None,
    prefetch_lead_s: float = 0.0,
    predictor_config: PredictorConfig | None = None,
    check_every: int = 0,
    progress: Callable[[int], None] | None = None,
    heads: int = 1,
    head_importance: Sequence[float] | None = None,
    policy_options: dict | None = None,
    observe: Callable[[int, Hierarchy, float | None], None] | None = None,
    lookahead_s: float = 0.0,
    answers_at_finish: bool = False,
) -> ReplayResult:
    """Replay `trace` through a hierarchy of `policy` tiers; optionally project TTFT.

    `observe(i, hierarchy, ttft_s)` is called after request `i` is served, with the
    request's projected TTFT (None without a cost model); it must only read the
    hierarchy (`kvcluster report` samples tier occupancy through it).

    With `heads > 1` every block is `heads` head shards and each tier holds
    capacity x heads shards; a block with some shards gone is a partial hit whose
    missing shards are recomputed (one block of prefill), with shards in a lower
    tier refetched from there.

    With `lookahead_s > 0` (single tier) the queue is known that far ahead: a
    block that a request arriving within `lookahead_s` of the current one will use
    is pinned (a victim that is pinned is put back with `admit`, which picks other
    victims). Any policy gets it the same way; it is information a live system has,
    reported apart from the figures without it.

    With `answers_at_finish` each request is served without how its answer ended, which is told right after
    (`Hierarchy.answered`): the order vLLM's connector sees, where the engine stores a request's blocks
    before it finishes.
    """
    if lookahead_s > 0 and len(plan) > 1:
        raise ValueError("lookahead_s pins blocks in a single tier; with several tiers use prefetch_lead_s")
    if heads > 1:
        trace = shard_trace(trace, heads)
        plan = [TierPlan(t.name, t.capacity_blocks * heads) for t in plan]
    hierarchy = build_hierarchy(policy, plan, predictor_config, heads, head_importance, policy_options)
    offline = POLICIES[policy].offline
    next_uses = trace.next_uses() if offline else None
    future: dict[int, int] | None = {} if offline else None
    prefetcher = Prefetcher(prefetch_lead_s) if prefetch_lead_s > 0 and len(plan) > 1 else None
    n_tiers = len(plan)
    ttfts: list[float] = []
    hits_total = partial_total = 0
    tier_hits = [0] * n_tiers
    ahead = 0
    queued: dict[int, int] = {}  # block -> queued requests (within lookahead_s) that use it
    seen_ahead = 0
    started = time.perf_counter()
    for i, blocks in enumerate(trace.blocks):
        ctx = request_context(trace, i, next_uses[i] if next_uses else None, future, not answers_at_finish)
        if heads > 1:
            per_tier, partial = shard_prefix(hierarchy, blocks, heads)
        if future is not None:
            future.update(zip(blocks, next_uses[i]))
        if lookahead_s > 0:
            for b in blocks:  # this request leaves the queue
                if i < seen_ahead:
                    left = queued.get(b, 0) - 1
                    if left > 0:
                        queued[b] = left
                    else:
                        queued.pop(b, None)
            seen_ahead = max(seen_ahead, i + 1)
            while seen_ahead < len(trace.blocks) and trace.arrivals[seen_ahead] <= ctx.now + lookahead_s:
                for b in trace.blocks[seen_ahead]:
                    queued[b] = queued.get(b, 0) + 1
                seen_ahead += 1
        result = hierarchy.serve(blocks, ctx)
        if answers_at_finish and ctx.session:
            hierarchy.answered(ctx.session, trace.finishes[i] if trace.finishes else "",
                               trace.output_tokens[i] if trace.output_tokens else 0)
        if lookahead_s > 0 and queued:
            _pin(hierarchy, result.dropped, queued, ctx)
        if heads == 1:
            per_tier, partial = [0] * n_tiers, 0
            for tier in result.hit_tier:
                per_tier[tier] += 1
        full = sum(per_tier)
        hits_total += full
        partial_total += partial
        for t in range(n_tiers):
            tier_hits[t] += per_tier[t]
        if prefetcher is not None:
            prefetcher.served(blocks, result.hit_tier)
            prefetcher.after(result)
        if prefetcher is not None:  # requests queued behind this one get their blocks lifted now
            ahead = max(ahead, i + 1)
            while ahead < len(trace.blocks) and trace.arrivals[ahead] <= ctx.now + prefetch_lead_s:
                prefetcher.prefetch(hierarchy, trace.blocks[ahead], ctx)
                ahead += 1
        if cost is not None:
            ttfts.append(cost.ttft(per_tier, trace.input_tokens[i], recomputed_blocks=partial))
        if check_every and i % check_every == 0:
            hierarchy.check_integrity()
        if observe is not None:
            observe(i, hierarchy, ttfts[-1] if cost is not None else None)
        if progress is not None:
            progress(1)
    seconds = time.perf_counter() - started
    refs = trace.block_refs
    if heads > 1:
        refs //= heads
    tiers = [
        {"name": t.name, "capacity_blocks": t.capacity_blocks // heads, "hits": h, "hit_rate": h / max(1, refs),
         "evictions": c.evictions}
        for t, c, h in zip(plan, hierarchy.counters, tier_hits)
    ]
    out = ReplayResult(
        policy=policy,
        capacity_blocks=sum(t.capacity_blocks for t in plan) // heads,
        tiers=tiers,
        hit_rate=hits_total / max(1, refs),
        partial_hit_rate=partial_total / max(1, refs),
        block_refs=refs,
        prefix_hits=hits_total,
        evictions=hierarchy.counters[-1].evictions,
        seconds=seconds,
    )
    if cost is not None:
        out.projected_ttft_s = _summary(ttfts)
        busy = sum(ttfts)
        out.throughput = {
            "requests_per_s": len(ttfts) / busy if busy else math.inf,
            "prefill_tokens_per_s": sum(trace.input_tokens) / busy if busy else math.inf,
        }
        out.cost = cost_per_million_prompt_tokens(cost.node, cost.tier_names, out.throughput["prefill_tokens_per_s"])
    if prefetcher is not None:
        out.prefetch = prefetcher.stats.__dict__.copy()
    predictor = getattr(hierarchy.policies[0], "predictor", None)
    if predictor is not None:
        out.predictor = _posteriors(predictor)
    return out


def _pin(hierarchy: Hierarchy, dropped: Sequence[int], queued: dict[int, int], ctx: RequestContext) -> None:
    """Put back the victims a queued request needs, letting the policy choose others (a few rounds at most)."""
    policy = hierarchy.policies[0]
    back = [b for b in dropped if b in queued]
    for _ in range(4):
        if not back:
            return
        again = policy.admit(back, ctx)
        back = [b for b in again if b in queued]


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean": sum(ordered) / len(ordered), "p50": pick(0.5), "p99": pick(0.99)}


def _posteriors(predictor: ReusePredictor) -> list[dict]:
    from .block_types import TransitionType

    rows = []
    for i, (a, b) in enumerate(zip(predictor.alpha, predictor.beta)):
        bt, tt = divmod(i, len(TransitionType))
        rows.append({"block_type": BlockType(bt).name.lower(), "transition": TransitionType(tt).name.lower(),
                     "alpha": a, "beta": b, "p_reuse": a / (a + b)})
    return rows
