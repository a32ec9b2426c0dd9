"""A node's DRAM pool lent to the cluster over NIXL, and the client tier that reads it.

`PeerPoolActor` (on the owning node) contains a `NixlPeerPool`; `RdmaTierActor`
(on another node) contains an `RDMABackend` whose control calls go to the
owner's actor handle, one call per batch, while the bytes move node to node
through NIXL (UCX: RDMA where the nodes have it, else TCP; `RDMABackend.medium` says which).
"""

from __future__ import annotations

import numpy as np
import ray

from kvcluster.storage import NixlPeerPool, RDMABackend
from kvcluster.storage.rdma import PeerUnavailable

from .index_actor import INDEX_NAME, NAMESPACE


@ray.remote(num_cpus=0, max_restarts=-1)
class PeerPoolActor:
    def __init__(self, node: str, slots: int, slot_bytes: int) -> None:
        self.node = node
        self.pool = NixlPeerPool(slots, slot_bytes, name=f"kvc-pool-{node}")
        self.index = ray.get_actor(INDEX_NAME, namespace=NAMESPACE)
        self.index.lost.remote(node, "dram")

    def put_local(self, keys: list[bytes], payloads: list[np.ndarray]) -> list[bool]:
        ok = self.pool.put_local(keys, payloads)
        self.index.stored.remote(self.node, "dram", [k for k, good in zip(keys, ok) if good])
        return ok

    def connect(self, client_metadata: bytes):
        return self.pool.connect(client_metadata)

    def reserve(self, keys: list[bytes], lengths: list[int]):
        return self.pool.reserve(keys, lengths)

    def commit(self, keys: list[bytes], slots: list[int], lengths: list[int], digests: list[int]) -> None:
        self.pool.commit(keys, slots, lengths, digests)
        self.index.stored.remote(self.node, "dram", keys)

    def lookup(self, keys: list[bytes]):
        return self.pool.lookup(keys)

    def release(self, keys: list[bytes]) -> int:
        self.index.removed.remote(self.node, "dram", keys)
        return self.pool.release(keys)

    def usage(self) -> int:
        return self.pool.usage()


class ActorPeerControl:
    """PeerControl over a PeerPoolActor handle: each method is one blocking batched call.

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


@ray.remote(num_cpus=0, max_restarts=-1)
class RdmaTierActor:
    def __init__(self, node: str, peer_node: str, staging_bytes: int, slots: int) -> None:
        peer = ray.get_actor(f"kvcluster/{peer_node}/pool", namespace=NAMESPACE)
        self.backend = RDMABackend(ActorPeerControl(peer), staging_bytes, slots, name=f"kvc-rdma-{node}-{peer_node}")

    def get_many(self, keys: list[bytes]) -> list[np.ndarray | None]:
        return self.backend.get_many(keys)

    def put_many(self, keys: list[bytes], payloads: list[np.ndarray]) -> list[bool]:
        return self.backend.put_many(list(zip(keys, payloads)))

    def stats(self) -> dict:
        return self.backend.stats()
