"""How replicas, the ingress, tier actors and replays reach the control plane, sharded or not.

A request's blocks go to the shards owning them (`shard_of`), one call per shard
that owns any, issued together; with one shard it is exactly one call. Shard 0
keeps the plain name and says how many shards there are.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import ray

from kvcluster.block_index import split_by_shard
from kvcluster.policies.base import RequestContext

from .control_plane_actor import CALL_TIMEOUT_S, CONTROL_NAME, control_name
from .index_actor import NAMESPACE


class ControlClient:
    """Handles of every control plane shard, shard 0 first."""

    def __init__(self, handles: Sequence) -> None:
        self.handles = list(handles)
        self.shards = len(self.handles)

    @classmethod
    def connect(cls, namespace: str = NAMESPACE) -> "ControlClient":
        """The running control plane's shards, found by name alone (ValueError when there is none).

        No call to a shard: a tier actor restarting in the middle of a plan connects from its constructor,
        while the shard running that plan waits on it."""
        handles = [ray.get_actor(CONTROL_NAME, namespace=namespace)]
        while True:
            try:
                handles.append(ray.get_actor(control_name(len(handles)), namespace=namespace))
            except ValueError:
                return cls(handles)

    def _parts(self, keys: Sequence[bytes]) -> dict[int, tuple[list[int], list[bytes]]]:
        if self.shards == 1:
            return {0: (list(range(len(keys))), list(keys))}
        return split_by_shard(keys, self.shards)

    def commit(self, node: str, keys: Sequence[bytes], payloads: Sequence[np.ndarray | None],
               ctx: RequestContext | None = None) -> list:
        """A replica served a request on `node`: each shard places its blocks (fire-and-forget refs)."""
        return [self.handles[s].commit.remote(node, owned, [payloads[p] for p in positions], ctx)
                for s, (positions, owned) in self._parts(keys).items()]

    def answered(self, node: str, session: str, finish: str, output_tokens: int) -> list:
        """How the answer to `session`'s latest request on `node` ended: every shard holds part of its blocks
        (fire-and-forget refs, ordered after this caller's `commit`s)."""
        return [h.answered.remote(node, session, finish, output_tokens) for h in self.handles]

    def prefetch(self, node: str, keys: Sequence[bytes], ctx: RequestContext | None = None) -> list:
        return [self.handles[s].prefetch.remote(node, owned, ctx) for s, (_, owned) in self._parts(keys).items()]

    def resync(self, tier_actor: str) -> list:
        """A tier actor restarted: every shard re-reads the part of it that it owns."""
        return [h.resync.remote(tier_actor) for h in self.handles]

    def serve(self, node: str, keys: Sequence[bytes], payloads: Sequence[np.ndarray], ctx: RequestContext,
              timeout_s: float = CALL_TIMEOUT_S * 2) -> tuple[list[int], list[np.ndarray]]:
        """A replay's request: each shard serves its blocks; the answer is the run across all of them (tier
        and bytes of each leading block held), as a prefix fetch would read it."""
        parts = self._parts(keys)
        refs = {s: self.handles[s].serve.remote(node, owned, [payloads[p] for p in positions], ctx)
                for s, (positions, owned) in parts.items()}
        got: dict[int, tuple[int, np.ndarray]] = {}
        for s, ref in refs.items():
            tiers, data = ray.get(ref, timeout=timeout_s)
            got.update(zip(parts[s][0], zip(tiers, data)))
        run = next((p for p in range(len(keys)) if p not in got), len(keys))
        return [got[p][0] for p in range(run)], [got[p][1] for p in range(run)]

    def stats(self, timeout_s: float = CALL_TIMEOUT_S) -> list[dict]:
        return ray.get([h.stats.remote() for h in self.handles], timeout=timeout_s)

