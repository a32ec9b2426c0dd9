"""Global block index: which node and tier hold which block key.

Kept consistent by batched events from tier actors (stored, removed, a whole
tier or node lost). Answers "longest prefix and where" for a request's keys in
one call. Pure logic; the index actor adds concurrency and naming.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from .keys import BlockKey
from .tiers import tier_rank

Location = tuple[str, str]  # (node, tier)


@dataclass(frozen=True)
class PrefixMatch:
    length: int  # leading keys held somewhere
    locations: tuple[tuple[Location, ...], ...]  # for each of them, every (node, tier) holding it, fastest first

    def best_node(self) -> str | None:
        """The node holding the most of the prefix (ties: the one with more fast-tier blocks)."""
        score: dict[str, tuple[int, int]] = {}
        for locs in self.locations:
            for node in {n for n, _ in locs}:
                fast = min(tier_rank(t) for n, t in locs if n == node)
                held, speed = score.get(node, (0, 0))
                score[node] = (held + 1, speed - fast)
        return max(score, key=lambda n: score[n]) if score else None


class BlockIndex:
    def __init__(self) -> None:
        self._where: dict[BlockKey, set[Location]] = {}
        self._by_location: dict[Location, set[BlockKey]] = defaultdict(set)
        self._pair: dict[BlockKey, int] = {}  # (block type, transition) pair as tiers report it; unread at present

    def stored(self, node: str, tier: str, keys: Iterable[BlockKey], pairs: Sequence[int] | None = None) -> None:
        loc = (node, tier)
        bucket = self._by_location[loc]
        keys = list(keys)
        for key in keys:
            self._where.setdefault(key, set()).add(loc)
            bucket.add(key)
        if pairs is not None:
            if len(pairs) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(pairs)} pairs")
            self._pair.update(zip(keys, pairs))

    def removed(self, node: str, tier: str, keys: Iterable[BlockKey]) -> None:
        loc = (node, tier)
        bucket = self._by_location.get(loc, set())
        for key in keys:
            bucket.discard(key)
            places = self._where.get(key)
            if places is not None:
                places.discard(loc)
                if not places:
                    del self._where[key]
                    self._pair.pop(key, None)

    def lost(self, node: str, tier: str | None = None) -> int:
        """A tier actor restarted empty, or a node left: forget what it held."""
        locs = [loc for loc in self._by_location if loc[0] == node and (tier is None or loc[1] == tier)]
        n = 0
        for loc in locs:
            keys = self._by_location.pop(loc)
            n += len(keys)
            self.removed(loc[0], loc[1], keys)
        return n

    def longest_prefix(self, keys: Sequence[BlockKey]) -> PrefixMatch:
        order = tier_rank
        locations = []
        for key in keys:
            places = self._where.get(key)
            if not places:
                break
            locations.append(tuple(sorted(places, key=lambda loc: (order(loc[1]), loc[0]))))
        return PrefixMatch(len(locations), tuple(locations))

    def locate(self, keys: Sequence[BlockKey]) -> list[tuple[Location, ...]]:
        """Every (node, tier) holding each key, fastest first; () for a key held nowhere. Unlike
        `longest_prefix` it does not stop at the first miss: a shard holds only some of a prefix."""
        order = tier_rank
        return [tuple(sorted(self._where.get(key, ()), key=lambda loc: (order(loc[1]), loc[0]))) for key in keys]

    def listing(self) -> list[tuple[str, str, list[BlockKey]]]:
        """What every location holds: the snapshot a read-only copy starts from."""
        return [(node, tier, list(keys)) for (node, tier), keys in self._by_location.items() if keys]

    def occupancy(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for (node, tier), keys in self._by_location.items():
            if keys:
                out[node][tier] = len(keys)
        return dict(out)

    def check_integrity(self) -> None:
        for key, places in self._where.items():
            assert places, "a key with no location"
            for loc in places:
                assert key in self._by_location[loc]
        for loc, keys in self._by_location.items():
            for key in keys:
                assert loc in self._where[key]


def shard_of(key: BlockKey, shards: int) -> int:
    """The index shard owning `key`. Keys are uniform digests, so their leading bytes spread evenly; every
    process computes the same shard (no per-process hash seed)."""
    return int.from_bytes(key[:8], "little") % shards


def split_by_shard(keys: Sequence[BlockKey], shards: int) -> dict[int, tuple[list[int], list[BlockKey]]]:
    """Shard -> (positions in `keys`, those keys): one batch per shard that owns any of them."""
    out: dict[int, tuple[list[int], list[BlockKey]]] = {}
    for pos, key in enumerate(keys):
        positions, owned = out.setdefault(shard_of(key, shards), ([], []))
        positions.append(pos)
        owned.append(key)
    return out


def merge_prefix(count: int, parts: Iterable[tuple[list[int], list[tuple[Location, ...]]]]) -> PrefixMatch:
    """The longest prefix of `count` keys from each shard's `locate` answer for the positions it owns."""
    located: list[tuple[Location, ...]] = [()] * count
    for positions, answers in parts:
        for pos, locs in zip(positions, answers):
            located[pos] = locs
    length = next((i for i, locs in enumerate(located) if not locs), count)
    return PrefixMatch(length, tuple(located[:length]))


def prefix_runs(lengths: Sequence[int], parts: Iterable[tuple[list[int], list[tuple[Location, ...]]]]) -> list[int]:
    """For chains of `lengths` keys asked together (flattened, chain after chain), how many leading keys of each
    chain some tier holds, from each shard's `locate` answer for the positions it owns."""
    located = [False] * sum(lengths)
    for positions, answers in parts:
        for pos, locs in zip(positions, answers):
            located[pos] = bool(locs)
    runs, start = [], 0
    for n in lengths:
        runs.append(next((i for i in range(n) if not located[start + i]), n))
        start += n
    return runs
