"""A node's DRAM pool lent to the cluster over NIXL, and the client tier that reads it.

`PeerPoolActor` (on the owning node) contains a `NixlPeerPool` of its own and
serves the NIXL peer protocol through `PeerServer`, as a memory `TierActor`
does for its tier's slab; `RdmaTierActor` (on another node) contains an
`RDMABackend` whose control calls go to the owner's actor handle
(`ActorPeerControl`), one call per batch, while the bytes move node to node
through NIXL (UCX: RDMA where the nodes have it, else TCP; `RDMABackend.medium` says which).
"""

from __future__ import annotations

import numpy as np
import ray

from kvcluster.storage import NixlPeerPool, RDMABackend

from .index_actor import NAMESPACE
from .index_client import IndexClient
from .index_reporter import IndexReporter
from .peer_control import ActorPeerControl
from .peer_server import PeerServer


@ray.remote(num_cpus=0, max_restarts=-1)
class PeerPoolActor(PeerServer):
    def __init__(self, node: str, slots: int, slot_bytes: int) -> None:
        self.node = node
        self.pool = NixlPeerPool(slots, slot_bytes, name=f"kvc-pool-{node}")
        self.reporter = IndexReporter(IndexClient.connect(), node, "dram")
        self.reporter.lost()

    def _lend(self) -> NixlPeerPool:
        return self.pool

    def put_local(self, keys: list[bytes], payloads: list[np.ndarray]) -> list[bool]:
        ok = self.pool.put_local(keys, payloads)
        self.reporter.stored([k for k, good in zip(keys, ok) if good])
        return ok


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
