"""The client's end of the NIXL peer protocol's control channel: a pool owner's Ray actor handle.

`RDMABackend` moves the bytes itself over NIXL; what it asks the owner (connect,
lookup, reserve, commit, release, usage) goes through a `PeerControl`. Here each
of those is one blocking batched call to the owner's actor (a `TierActor` or a
`PeerPoolActor`, both serve it through `PeerServer`).
"""

from __future__ import annotations

import ray

from kvcluster.storage.base import PeerUnavailable


class ActorPeerControl:
    """PeerControl over the handle of an actor that serves the peer protocol: each method is one blocking call.

    An owner that does not answer within `timeout_s` (its node left, it is
    restarting) raises PeerUnavailable, which the backend turns into misses.
    """

    def __init__(self, handle, timeout_s: float = 5.0) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    def __getattr__(self, method: str):
        remote = getattr(self.handle, method)

        def call(*args):
            try:
                return ray.get(remote.remote(*args), timeout=self.timeout_s)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:  # dead, unschedulable, slow
                raise PeerUnavailable(f"peer pool {method}: {type(exc).__name__}") from None

        return call
