"""The policy engine's hierarchy bound to real backends: its decisions move real bytes.

`fetch` finds a request's prefix run across the tiers and loads it with one
`get_many` per tier; a missing or corrupt payload ends the run there (the rest
is recomputed, never served wrong) and the block leaves the bookkeeping.
The digest a tier verified travels with the bytes it read (`read_verified`): the
tier they move to stores it rather than summing them again, or, where it copies
them anyway, refuses bytes that no longer match it.
`commit` then lets the hierarchy serve the request and carries out what it
decided: promoted blocks are written to tier 0 from the bytes just fetched, new
blocks are stored, victims are copied one tier down (batched per tier pair),
and blocks falling off the last tier are deleted. A put a backend refuses leaves
that block a miss. Capacities are the backends' bytes / the layout's block bytes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..hierarchy import Hierarchy
from ..keys import BlockKey
from ..policies.base import RequestContext
from ..policies.registry import make_policy
from .base import StorageBackend


@dataclass(frozen=True)
class FetchResult:
    hits: int  # blocks of the verified prefix run
    payloads: tuple[np.ndarray, ...]  # their bytes, in order
    tiers: tuple[str, ...]  # the tier each came from
    dropped_corrupt: int  # blocks found in the index whose bytes failed verification


class TieredStore:
    def __init__(self, backends: Sequence[StorageBackend], block_bytes: int, policy: str = "lru", **policy_options):
        self.backends = list(backends)
        self.block_bytes = block_bytes
        policies = [make_policy(policy, b.capacity_bytes // block_bytes, **policy_options) for b in self.backends]
        self.hierarchy = Hierarchy([b.name for b in self.backends], policies)
        self._ids: dict[BlockKey, int] = {}
        self._keys: list[BlockKey] = []
        self._fetched: dict[int, np.ndarray] = {}
        self._digests: dict[int, int] = {}  # block -> digest verified when `fetch` read it
        self.evictions = [0] * len(self.backends)  # blocks each tier gave up by policy decision, so far

    def _intern(self, keys: Sequence[BlockKey]) -> list[int]:
        ids = self._ids
        out = []
        for key in keys:
            i = ids.get(key)
            if i is None:
                i = ids[key] = len(self._keys)
                self._keys.append(key)
            out.append(i)
        return out

    def fetch(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> FetchResult:
        """Load the longest cached prefix of `keys`: one batched read per tier (into `out[j]` when given)."""
        ids = self._intern(keys)
        tiers = self.hierarchy.prefix_tiers(ids)
        by_tier: dict[int, list[int]] = defaultdict(list)
        for j, tier in enumerate(tiers):
            by_tier[tier].append(j)
        loaded: dict[int, np.ndarray | None] = {}
        verified: dict[int, int | None] = {}
        for tier, positions in by_tier.items():
            got, digests = self.backends[tier].read_verified([keys[j] for j in positions],
                                                             None if out is None else [out[j] for j in positions])
            loaded.update(zip(positions, got))
            verified.update(zip(positions, digests))
        payloads, names, corrupt = [], [], 0
        for j, tier in enumerate(tiers):
            data = loaded[j]
            if data is None:  # in the index but unreadable: a miss from here on
                self.hierarchy.policies[tier].discard([ids[j]])
                corrupt += 1
                break
            payloads.append(data)
            names.append(self.backends[tier].name)
        self._fetched = {ids[j]: p for j, p in enumerate(payloads)}
        self._digests = {ids[j]: verified[j] for j in range(len(payloads)) if verified[j] is not None}
        return FetchResult(len(payloads), tuple(payloads), tuple(names), corrupt)

    def commit(self, keys: Sequence[BlockKey], new_payloads: Sequence[np.ndarray | None], ctx: RequestContext) -> None:
        """After a request ran: make its blocks resident per the policy and move the bytes.

        `new_payloads[j]` is the KV of block j when it was computed by this request
        (None for blocks that came from `fetch`).
        """
        ids = self._intern(keys)
        payload = dict(self._fetched)
        digests = dict(self._digests)
        for j, p in enumerate(new_payloads):
            if p is not None:  # computed by this request: no digest yet
                payload[ids[j]] = p
                digests.pop(ids[j], None)
        ids = [i for i in ids if i in payload or self.hierarchy.locate(i) == 0]
        result = self.hierarchy.serve(ids, ctx)
        for _, src, _ in result.demoted:
            self.evictions[src] += 1
        self.evictions[-1] += len(result.dropped)
        for block, src in result.promoted:  # their bytes are in `payload`: free the space below first
            self.backends[src].delete([self._keys[block]])
        self._delete_everywhere(result.dropped)
        moves: dict[tuple[int, int], list[int]] = defaultdict(list)
        for block, src, dst in result.demoted:
            moves[(src, dst)].append(block)
        for (src, dst), blocks in sorted(moves.items(), reverse=True):  # empty deeper tiers before filling them
            self._move(blocks, src, dst, payload, digests)
        top, top_backend = self.hierarchy.policies[0], self.backends[0]
        fresh = [b for b in ids if b in top and b in payload]
        have = top_backend.contains([self._keys[b] for b in fresh])
        self._put(0, [b for b, present in zip(fresh, have) if not present], payload, digests)
        self._fetched, self._digests = {}, {}

    def _move(self, blocks: list[int], src: int, dst: int, payload: dict[int, np.ndarray],
              digests: dict[int, int]) -> None:
        """Copy blocks from tier src to tier dst (bytes from this request when it has them), digests along."""
        from_backend = [b for b in blocks if b not in payload]
        got, verified = self.backends[src].read_verified([self._keys[b] for b in from_backend]) if from_backend \
            else ([], [])  # nothing to read: no call (for an rdma tier, a control call to its peer)
        carried = {b: payload.get(b) for b in blocks} | dict(zip(from_backend, got))
        known = {b: digests[b] for b in blocks if b in digests} | \
            {b: d for b, d in zip(from_backend, verified) if d is not None}
        readable = {b: d for b, d in carried.items() if d is not None}
        self._put(dst, list(readable), readable, known)
        self.hierarchy.policies[dst].discard([b for b in blocks if b not in readable])  # unreadable: gone
        self.backends[src].delete([self._keys[b] for b in blocks])

    def _put(self, tier: int, blocks: list[int], payload: dict[int, np.ndarray], digests: dict[int, int]) -> None:
        if not blocks:
            return
        ok = self.backends[tier].put_many([(self._keys[b], payload[b]) for b in blocks],
                                          [digests.get(b) for b in blocks])
        self.hierarchy.policies[tier].discard([b for b, good in zip(blocks, ok) if not good])

    def _delete_everywhere(self, blocks: Sequence[int]) -> None:
        keys = [self._keys[b] for b in blocks]
        if keys:
            for backend in self.backends:
                backend.delete(keys)

    def check_integrity(self) -> None:
        """Every block the hierarchy holds in a tier is readable from that tier's backend."""
        self.hierarchy.check_integrity()
        for policy, backend in zip(self.hierarchy.policies, self.backends):
            resident = list(policy.resident())
            present = backend.contains([self._keys[b] for b in resident])
            assert all(present), f"{backend.name}: the index holds blocks the backend lacks"
            backend.check_integrity()
