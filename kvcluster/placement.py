"""Placement planning: which blocks to move between tiers and nodes, and where.

Pure logic over a snapshot (who holds what, tier capacities, P(reuse) per key);
the placement controller actor reads that snapshot in a few batched calls,
runs `plan_moves`, and carries the moves out copy-first: a move's source is
dropped only after its destination acknowledged the bytes, so a block is never
in zero places. Planning is idempotent: a move whose destination already holds
the key only drops the source; a plan made from the state it produced is empty.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .block_index import Location
from .keys import BlockKey
from .tiers import TIER_ORDER

DURABLE_TIERS = frozenset({"pfs"})  # a copy here is kept when a block moves up


class PlacementConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    high_water: float = Field(0.9, gt=0, le=1, description="Demote from a tier filled above this fraction.")
    low_water: float = Field(0.75, ge=0, lt=1, description="... down to this fraction.")
    promote_above: float = Field(0.6, ge=0, le=1, description="P(reuse) at which a block moves up a tier.")
    max_moves: int = Field(1024, gt=0, description="Moves per planning round (bounds one round's traffic).")

    @model_validator(mode="after")
    def _waters(self) -> "PlacementConfig":
        if self.low_water >= self.high_water:
            raise ValueError(f"low_water ({self.low_water}) must be below high_water ({self.high_water})")
        return self


@dataclass(frozen=True)
class Move:
    key: BlockKey
    src: Location
    dst: Location
    reason: str  # demote | spill | promote | migrate
    copy: bool  # False when dst already holds the key: only the source is dropped
    drop_source: bool


@dataclass(frozen=True)
class Migration:
    """A session's blocks should be on `node`, whose replica will serve its next request."""

    keys: tuple[BlockKey, ...]
    node: str


def plan_moves(holdings: Mapping[Location, Sequence[BlockKey]], capacity: Mapping[Location, int],
               p_reuse: Callable[[BlockKey], float], config: PlacementConfig | None = None,
               migrations: Sequence[Migration] = ()) -> list[Move]:
    """Moves for one round: migrations first, then demotions of full tiers, then promotions of hot blocks."""
    cfg = config or PlacementConfig()
    where: dict[BlockKey, set[Location]] = defaultdict(set)
    for loc, keys in holdings.items():
        for k in keys:
            where[k].add(loc)
    load = {loc: len(holdings.get(loc, ())) for loc in capacity}
    moves: list[Move] = []

    def room(loc: Location, limit: float) -> bool:
        return load[loc] + 1 <= limit * capacity[loc]

    def add(key: BlockKey, src: Location, dst: Location, reason: str, drop: bool) -> None:
        copy = dst not in where[key]
        if copy:
            load[dst] += 1
            where[key].add(dst)
        if drop:
            load[src] -= 1
            where[key].discard(src)
        if copy or drop:
            moves.append(Move(key, src, dst, reason, copy, drop))

    def tiers_of(node: str) -> list[str]:
        return sorted((t for n, t in capacity if n == node), key=TIER_ORDER.index)

    for mig in migrations:
        fast = [t for t in tiers_of(mig.node) if t != "pfs"]
        if not fast:
            continue
        dst = (mig.node, fast[0])
        for key in mig.keys:
            if len(moves) >= cfg.max_moves:
                return moves
            if any(n == mig.node for n, _ in where.get(key, ())) or key not in where:
                continue  # already on the node, or held nowhere (a miss: nothing to move)
            if not room(dst, 1.0):
                break
            src = min(where[key], key=lambda loc: TIER_ORDER.index(loc[1]))
            add(key, src, dst, "migrate", drop=False)  # the old copy ages out by demotion

    for loc in sorted(capacity, key=lambda loc: (TIER_ORDER.index(loc[1]), loc[0])):
        node, tier = loc
        if load[loc] <= cfg.high_water * capacity[loc]:
            continue
        lower = [(node, t) for t in tiers_of(node) if TIER_ORDER.index(t) > TIER_ORDER.index(tier)]
        coldest = sorted((k for k in holdings.get(loc, ()) if loc in where[k]), key=lambda k: (p_reuse(k), k))
        for key in coldest:
            if load[loc] <= cfg.low_water * capacity[loc] or len(moves) >= cfg.max_moves:
                break
            dst = next((d for d in lower if d in where[key] or room(d, cfg.high_water)), None)
            if dst is None:
                break  # nowhere below has room: the tier's own eviction decides
            add(key, loc, dst, "spill" if dst[1] == "pfs" else "demote", drop=True)

    hot = sorted(where, key=lambda k: (-p_reuse(k), k))
    for key in hot:
        if p_reuse(key) < cfg.promote_above or len(moves) >= cfg.max_moves:
            break
        for node in sorted({n for n, _ in where[key]}):
            here = sorted((loc for loc in where[key] if loc[0] == node), key=lambda loc: TIER_ORDER.index(loc[1]))
            src = here[0]
            upper = [(node, t) for t in tiers_of(node) if TIER_ORDER.index(t) < TIER_ORDER.index(src[1])]
            dst = next((d for d in upper if room(d, cfg.low_water)), None)
            if dst is not None:
                add(key, src, dst, "promote", drop=src[1] not in DURABLE_TIERS)
    return moves


def group_moves(moves: Sequence[Move]) -> dict[tuple[Location, Location], list[Move]]:
    """Moves batched by (source, destination): one get and one put per pair, never one call per block."""
    groups: dict[tuple[Location, Location], list[Move]] = defaultdict(list)
    for m in moves:
        groups[(m.src, m.dst)].append(m)
    return dict(groups)
