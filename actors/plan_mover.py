"""A node controller's moves between its own tier actors, with the bytes going tier to tier.

A `StorePlan`'s moves (promotions, demotions, drops) run in two rounds: read
every moving block at its source, then in one call per tier actor, all in flight
together, delete what leaves that tier (the room the policy counted on) and write
what lands there. The reads' results stay in Ray's object store: the controller
holds only their `ObjectRef`s and passes each to the destination tier actor as a
call argument, which Ray resolves there (`TierActor.put_read`). So the bytes go
source tier -> object store -> destination tier on the node, and never through
the controller's process; it waits for the reads to finish (`fetch_local=False`)
before anything is deleted, so no block is deleted before its copy exists.
"""

from __future__ import annotations

import logging
from typing import Sequence

import ray

from kvcluster.cache_manager import StorePlan

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 120.0


class RemoteMover:
    """Tier index -> tier actor of one node; `run` carries a plan's moves out, per (source, destination)."""

    def __init__(self, actors: Sequence, names: Sequence[str], timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.actors = list(actors)
        self.names = list(names)
        self.timeout_s = timeout_s

    def run(self, plan: StorePlan) -> list[bytes]:
        """Every move of `plan` whose source is a tier (the caller writes the others). Returns the keys that
        did not reach their destination: unreadable at the source, refused at the destination, or on a
        tier actor that died meanwhile (a miss, never a block claimed where it is not)."""
        pairs: dict[tuple[int, int], list[bytes]] = {}
        for m in plan.moves:
            if m.src is not None and m.dst is not None:
                pairs.setdefault((m.src, m.dst), []).append(m.key)
        reads = {pair: self.actors[pair[0]].read_verified.remote(keys) for pair, keys in pairs.items()}
        unread = self._wait(reads)
        failed = [k for pair in unread for k in pairs[pair]]
        deletes = plan.deletes()
        writes, evicted = {}, set()
        for pair, ref in reads.items():  # a tier's first write deletes what leaves it (its calls run in order)
            if pair in unread:
                continue
            dst = pair[1]
            evict = deletes.get(dst) if dst not in evicted else None
            evicted.add(dst)
            writes[pair] = self.actors[dst].put_read.remote(pairs[pair], ref, evict)
        only_deleted = {t: self.actors[t].delete.remote(ks) for t, ks in deletes.items() if t not in evicted}
        self._gather(only_deleted, "delete")
        for pair, ok in self._gather(writes, "write").items():
            keys = pairs[pair]
            failed.extend(keys if ok is None else [k for k, good in zip(keys, ok) if not good])
        return failed

    def delete(self, keys: dict[int, list[bytes]]) -> None:
        self._gather({t: self.actors[t].delete.remote(ks) for t, ks in keys.items()}, "delete")

    def _wait(self, refs: dict) -> set:
        """The reads not done within the timeout (their source tier hung); the others are done, their bytes
        not fetched here. A read that raised is done too: its error reaches its write, whose keys then fail."""
        if not refs:
            return set()
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s, fetch_local=False)
        ready = set(ready)
        return {pair for pair, ref in refs.items() if ref not in ready}

    def _gather(self, refs: dict, what: str) -> dict:
        """Each call's answer; one whose actor died or timed out answers None (its keys failed)."""
        out = {}
        for where, ref in refs.items():
            try:
                out[where] = ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("tier %s of a plan's %s unavailable (%s): its blocks are misses", where, what,
                            type(exc).__name__)
                out[where] = None
        return out
