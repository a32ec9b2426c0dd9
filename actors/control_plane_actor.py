"""The cluster's control plane as one actor: the cache manager, and the mover that carries out its plans.

It holds the very `ControlPlane` a replica runs over its own tiers and the simulator's
hierarchy runs inside, bound here to tier actors (`ActorTierIO`): every round of a
plan is one call per tier actor involved, issued together. Plans run one at a time,
in the order the manager issued them (a plan's sources are where the previous one
left the blocks), so the manager's view and the tiers' bytes agree after each call.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import ray

from kvcluster.cache_manager import CacheManager
from kvcluster.control_plane import ControlPlane
from kvcluster.policies.base import RequestContext
from kvcluster.simulator import TierPlan

CONTROL_NAME = "kvcluster/control"
CALL_TIMEOUT_S = 120.0


class ActorTierIO:
    """Tier index -> tier actor; each round is one remote call per tier actor, gathered together."""

    def __init__(self, actors: Sequence) -> None:
        self.actors = list(actors)

    def _gather(self, calls: dict[int, ray.ObjectRef]) -> dict:
        tiers = list(calls)
        return dict(zip(tiers, ray.get([calls[t] for t in tiers], timeout=CALL_TIMEOUT_S)))

    def read(self, keys: Mapping[int, list[bytes]], out=None):
        return self._gather({t: self.actors[t].read_verified.remote(ks) for t, ks in keys.items()})

    def delete(self, keys: Mapping[int, list[bytes]]) -> None:
        self._gather({t: self.actors[t].delete.remote(ks) for t, ks in keys.items()})

    def write(self, items):
        # positional: keys, payloads, pairs, prefetch, digests, overflow (a mover never overflows: the
        # plan's deletes made the room)
        return self._gather({t: self.actors[t].put_many.remote(ks, ps, None, False, ds, False)
                             for t, (ks, ps, ds) in items.items()})


@ray.remote(num_cpus=0)
class ControlPlaneActor:
    def __init__(self, tiers: list[tuple[str, str, int]], policy: str, policy_options: dict | None = None) -> None:
        """`tiers`: (label, tier actor name, capacity in blocks), fastest first."""
        from .index_actor import NAMESPACE

        self.labels = [label for label, _, _ in tiers]
        actors = [ray.get_actor(name, namespace=NAMESPACE) for _, name, _ in tiers]
        self.manager = CacheManager([TierPlan(label, cap) for label, _, cap in tiers], policy,
                                    policy_options=policy_options)
        self.plane = ControlPlane(self.manager, ActorTierIO(actors))
        self.requests = 0

    def serve(self, keys: list[bytes], payloads: list[np.ndarray], ctx: RequestContext | None = None
              ) -> tuple[list[int], list[np.ndarray]]:
        """One request: the verified cached run (tier index and bytes of each block), then its placement,
        with `payloads[j]` standing in for block j's computed KV past the run."""
        self.requests += 1
        got = self.plane.serve(keys, dict(zip(keys, payloads)), ctx)
        self.manager.drain_events()
        return list(got.tiers), list(got.payloads)

    def stats(self) -> dict:
        return {"tiers": self.labels, "occupancy": self.manager.occupancy(), "counters": self.manager.counters(),
                "tracked_blocks": self.manager.tracked(), "requests": self.requests}
