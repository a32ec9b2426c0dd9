"""N capacity-bounded tiers, fastest first, sharing one exclusive residency.

A block lives in at most one tier. Serving a request finds its prefix run across
all tiers, promotes every block of the request into tier 0, and lets each tier's
victims fall to the tier below (its policy decides whether they stay there);
what falls out of the last tier is gone. Pure logic: the live system binds each
tier to a storage backend and moves the bytes this class decides to move.

`build_hierarchy` makes one from a policy name and a `TierPlan` per tier: the
simulator, the cache manager and the cluster simulator all build theirs here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Container, Sequence

from .policies.base import EvictionPolicy, RequestContext
from .policies.registry import make_policy
from .predictor import PredictorConfig, ReusePredictor


def leading_tiers(locate: Callable[[int], int | None], blocks: Sequence[int]) -> list[int]:
    """Tier of each block of the leading run that `locate` finds somewhere."""
    out = []
    for block in blocks:
        tier = locate(block)
        if tier is None:
            break
        out.append(tier)
    return out


@dataclass(frozen=True)
class ServeResult:
    """What serving one request did, for stats and for the byte mover."""

    hit_tier: tuple[int, ...]  # tier index of each block of the prefix run
    promoted: tuple[tuple[int, int], ...]  # (block, from tier) moved up into tier 0
    demoted: tuple[tuple[int, int, int], ...]  # (block, from tier, to tier)
    dropped: tuple[int, ...]  # fell out of the last tier
    dropped_from: tuple[int, ...] = ()  # the tier each dropped block left (a block may bypass tiers)

    @property
    def prefix_hits(self) -> int:
        return len(self.hit_tier)


@dataclass
class TierCounters:
    hits: int = 0
    promotions_out: int = 0
    demotions_in: int = 0
    evictions: int = 0


@dataclass
class Hierarchy:
    """Tiers in order; `names[i]` labels `policies[i]`."""

    names: list[str]
    policies: list[EvictionPolicy]
    counters: list[TierCounters] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.names) != len(self.policies) or not self.policies:
            raise ValueError("a hierarchy needs one name per tier and at least one tier")
        self.counters = [TierCounters() for _ in self.policies]

    def locate(self, block: int) -> int | None:
        """Index of the tier holding `block`, or None."""
        for i, policy in enumerate(self.policies):
            if block in policy:
                return i
        return None

    def prefix_tiers(self, blocks: Sequence[int]) -> list[int]:
        """Tier of each block in the leading run that is resident somewhere."""
        if len(self.policies) == 1:
            return [0] * self.policies[0].prefix_hits(blocks)
        return leading_tiers(self.locate, blocks)

    def serve(self, blocks: Sequence[int], ctx: RequestContext, pinned: Container[int] = ()) -> ServeResult:
        """Count the prefix hit, then make every block of the request resident in tier 0.

        `pinned` blocks (being read by someone) are put back when a tier picks them as victims,
        so that tier's policy picks others; see `_keep_pinned`."""
        hit_tier = self.prefix_tiers(blocks)
        for tier in hit_tier:
            self.counters[tier].hits += 1
        promoted = self._pull_up(blocks)
        evicted = self.policies[0].access(blocks, ctx)
        demoted, dropped, dropped_from = self._cascade(evicted, 0, ctx, pinned)
        return ServeResult(tuple(hit_tier), tuple(promoted), tuple(demoted), tuple(dropped), tuple(dropped_from))

    def promote(self, blocks: Sequence[int], ctx: RequestContext, pinned: Container[int] = ()) -> ServeResult:
        """Prefetch: move `blocks` held in lower tiers into tier 0 without counting a use (no hits)."""
        promoted = self._pull_up(blocks)
        moved = [b for b, _ in promoted]
        evicted = self.policies[0].admit(moved, ctx) if moved else []
        demoted, dropped, dropped_from = self._cascade(evicted, 0, ctx, pinned)
        return ServeResult((), tuple(promoted), tuple(demoted), tuple(dropped), tuple(dropped_from))

    def place(self, blocks: Sequence[int], ctx: RequestContext, pinned: Container[int] = ()) -> ServeResult:
        """Blocks no tier holds, whose bytes arrived from elsewhere (another node), into tier 0 without counting
        a use (no hits): the request that read them counts it. Blocks a tier holds stay where they are."""
        fresh = [b for b in dict.fromkeys(blocks) if self.locate(b) is None]
        evicted = self.policies[0].admit(fresh, ctx) if fresh else []
        demoted, dropped, dropped_from = self._cascade(evicted, 0, ctx, pinned)
        return ServeResult((), (), tuple(demoted), tuple(dropped), tuple(dropped_from))

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        """How the answer to `session`'s latest request ended, told after its blocks were stored: every tier's
        policy may re-class them (`EvictionPolicy.answered`)."""
        for policy in self.policies:
            policy.answered(session, finish, output_tokens)

    def _pull_up(self, blocks: Sequence[int]) -> list[tuple[int, int]]:
        promoted = []
        for tier in range(1, len(self.policies)):
            policy = self.policies[tier]
            found = [b for b in blocks if b in policy]
            if found:
                policy.discard(found)
                self.counters[tier].promotions_out += len(found)
                promoted.extend((b, tier) for b in found)
        return promoted

    def _cascade(self, evicted: list[int], tier: int, ctx: RequestContext, pinned: Container[int] = ()):
        """Victims fall tier by tier. Each landing is reported as (block, origin, tier it landed in),
        where origin is the tier the block left, even if it bypassed tiers in between; blocks that
        fall out of the last tier are returned with their origins."""
        demoted: list[tuple[int, int, int]] = []
        origin = {b: tier for b in evicted}
        while evicted:
            if pinned:
                evicted, kept = self._keep_pinned(evicted, tier, ctx, pinned)
                demoted.extend((b, origin[b], tier) for b in kept if origin.get(b, tier) != tier)  # landed here
                for b in evicted:
                    origin.setdefault(b, tier)
            self.counters[tier].evictions += len(evicted)
            below = tier + 1
            if below == len(self.policies):
                return demoted, evicted, [origin[b] for b in evicted]
            lower = self.policies[below]
            next_evicted = lower.admit(evicted, ctx)
            demoted.extend((b, origin[b], below) for b in evicted if b in lower)
            self.counters[below].demotions_in += len(evicted)
            origin = {b: origin.get(b, below) for b in next_evicted}
            evicted, tier = next_evicted, below
        return demoted, [], []

    def _keep_pinned(self, evicted: list[int], tier: int, ctx: RequestContext, pinned: Container[int]
                     ) -> tuple[list[int], list[int]]:
        """Re-admit pinned victims into `tier`, whose policy then picks other victims. A few rounds
        at most: if every candidate is pinned the tier is over-pinned and a pinned block falls
        (the reader then sees a miss, never wrong bytes). Returns (victims, pinned blocks kept here)."""
        policy = self.policies[tier]
        out = [b for b in evicted if b not in pinned]
        back = [b for b in evicted if b in pinned]
        readmitted = list(back)
        for _ in range(4):
            if not back:
                break
            again = policy.admit(back, ctx)
            out.extend(b for b in again if b not in pinned)
            back = [b for b in again if b in pinned]
        out.extend(back)
        return out, [b for b in readmitted if b in policy]

    def __contains__(self, block: int) -> bool:
        return self.locate(block) is not None

    def __len__(self) -> int:
        return sum(len(p) for p in self.policies)

    def check_integrity(self) -> None:
        """Each tier is consistent, within capacity, and no block sits in two tiers."""
        for policy in self.policies:
            policy.check_integrity()
        union = set().union(*(p.resident() for p in self.policies))
        assert len(union) == len(self), "a block is resident in two tiers"


LEARNS_FROM_USES = ("bayes",)  # policies that run in tier 0 only (see build_hierarchy)


@dataclass(frozen=True)
class TierPlan:
    """A tier of a hierarchy: its name and capacity in blocks."""

    name: str
    capacity_blocks: int


def build_hierarchy(
    policy: str,
    plan: Sequence[TierPlan],
    predictor_config: PredictorConfig | None = None,
    heads: int = 1,
    head_importance: Sequence[float] | None = None,
    policy_options: dict | None = None,
) -> Hierarchy:
    """One policy instance per tier; each `bayes-v1` tier learns its own traffic's posteriors.

    `bayes` runs in tier 0 only, with LRU below it. Its reuse-gap model learns from uses, and only
    tier 0 sees them (a hit anywhere promotes into tier 0): a lower tier running it would rank every
    demoted block with a model that never saw one reused, and bypass them. Below tier 0 the order of
    demotion is the order of tier 0's policy, so LRU there extends that ranking downwards (the tiers
    then act as one larger cache). Measured on the shared traces, three tiers at 1/2/5% and 2/5/10% of
    the unique blocks: bayes in every tier fell below LRU at 6 of 8 points, bayes over LRU is at or
    above LRU at 7 of 8 (`benchmarks/RESULTS.md`)."""
    policies = []
    for tier in plan:
        kwargs: dict = dict(policy_options or {})
        if policy == "bayes-v1":
            kwargs.update(predictor=ReusePredictor(predictor_config), heads=heads, head_importance=head_importance)
        if policy in LEARNS_FROM_USES and policies:
            policies.append(make_policy("lru", tier.capacity_blocks))  # see below
            continue
        policies.append(make_policy(policy, tier.capacity_blocks, **kwargs))
    return Hierarchy([t.name for t in plan], policies)
