"""The manager state split by key hash: N hierarchies, each over 1/N of every tier.

One control plane actor plans every request of the cluster; past its rate, the
state splits over N actors, each owning the blocks whose key hashes to it and a
share of every tier's capacity (the shares add up to the tier, so a tier still
never receives more than it holds). A request goes to each shard with the blocks
it owns, in order, and each shard's policy decides for those alone.

`ShardedHierarchy` is that split as the simulator replays it: the same
hierarchies, fed the same sub-requests, so a live cluster with N control plane
shards hits what `replay(..., shards=N)` says. A block counts as a hit only inside
the request's prefix run across all shards (a block one shard holds after another
shard's miss is past the run, as in a real prefix fetch).
"""

from __future__ import annotations

from typing import Callable, Container, Sequence

from .hierarchy import Hierarchy, ServeResult, TierCounters, leading_tiers
from .policies.base import RequestContext


def shard_capacities(capacity: int, shards: int) -> list[int]:
    """A tier's blocks split over `shards`: equal shares, the remainder to the first ones."""
    if capacity < shards:
        raise ValueError(f"a tier of {capacity} blocks cannot be split over {shards} control plane shards")
    share, extra = divmod(capacity, shards)
    return [share + (i < extra) for i in range(shards)]


def split_blocks(blocks: Sequence[int], shard_of: Callable[[int], int]) -> dict[int, list[int]]:
    """Shard -> its blocks of the request, in request order."""
    out: dict[int, list[int]] = {}
    for block in blocks:
        out.setdefault(shard_of(block), []).append(block)
    return out


class ShardedHierarchy:
    """`shards[i]` holds the blocks `shard_of` maps to i; serving splits each request among them."""

    def __init__(self, shards: Sequence[Hierarchy], shard_of: Callable[[int], int]) -> None:
        if not shards:
            raise ValueError("a sharded hierarchy needs at least one shard")
        self.shards = list(shards)
        self.names = self.shards[0].names
        self.shard_of = shard_of

    @property
    def counters(self) -> list[TierCounters]:
        out = [TierCounters() for _ in self.names]
        for shard in self.shards:
            for total, c in zip(out, shard.counters):
                total.hits += c.hits
                total.promotions_out += c.promotions_out
                total.demotions_in += c.demotions_in
                total.evictions += c.evictions
        return out

    def locate(self, block: int) -> int | None:
        return self.shards[self.shard_of(block)].locate(block)

    def prefix_tiers(self, blocks: Sequence[int]) -> list[int]:
        return leading_tiers(self.locate, blocks)

    def serve(self, blocks: Sequence[int], ctx: RequestContext, pinned: Container[int] = ()) -> ServeResult:
        hit_tier = self.prefix_tiers(blocks)
        parts = [self.shards[s].serve(sub, ctx, pinned) for s, sub in split_blocks(blocks, self.shard_of).items()]
        return _merged(tuple(hit_tier), parts)

    def promote(self, blocks: Sequence[int], ctx: RequestContext, pinned: Container[int] = ()) -> ServeResult:
        parts = [self.shards[s].promote(sub, ctx, pinned) for s, sub in split_blocks(blocks, self.shard_of).items()]
        return _merged((), parts)

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        """Each shard holds part of the session's latest request: each re-classes its part."""
        for shard in self.shards:
            shard.answered(session, finish, output_tokens)

    def check_integrity(self) -> None:
        for i, shard in enumerate(self.shards):
            shard.check_integrity()
            for policy in shard.policies:
                assert all(self.shard_of(b) == i for b in policy.resident()), "a block in another key's shard"

    def __contains__(self, block: int) -> bool:
        return self.locate(block) is not None

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)


def _merged(hit_tier: tuple[int, ...], parts: list[ServeResult]) -> ServeResult:
    return ServeResult(hit_tier, tuple(x for p in parts for x in p.promoted), tuple(x for p in parts for x in p.demoted),
                       tuple(x for p in parts for x in p.dropped), tuple(x for p in parts for x in p.dropped_from))
