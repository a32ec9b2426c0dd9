"""The NIXL client side of a tier: copying blocks from another node's memory tier into this one.

One control call to the source (`lookup`, through `ActorPeerControl`), then the
bytes move node to node in one NIXL read per batch. A memory tier registers its
own pool with the pull's NIXL agent and reserves slots in it, so the source's
bytes land directly in the slots they are served from (one read, one checksum
pass, no copy). Other tiers read through a staging buffer and store what arrived
intact, with the digests it was verified against.

The puller moves bytes and counts them; what the tier tells the index, its
prefetch tracker and its metrics about the result is the tier's business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import ray

from kvcluster import storage  # NIXL's backends load torch: a tier loads them with its first pull or loan
from kvcluster.keys import BlockKey
from kvcluster.storage.base import StorageError

from .index_actor import NAMESPACE
from .peer_control import ActorPeerControl

if TYPE_CHECKING:
    from kvcluster.storage import NixlPeerPool, RDMABackend

Store = Callable[[list[bytes], list[np.ndarray], list[int | None]], list[bool]]
Connect = Callable[[str, int, str], "RDMABackend"]


def connect_actor(source: str, staging_bytes: int, name: str) -> RDMABackend:
    """A NIXL client (agent `name`) of the pool lent by the actor named `source`; ValueError if it is gone."""
    handle = ray.get_actor(source, namespace=NAMESPACE)
    return storage.RDMABackend(ActorPeerControl(handle, timeout_s=30), staging_bytes, 1, name=name)


class NixlPuller:
    def __init__(self, name: str, store: Store, lend: Callable[[], NixlPeerPool] | None = None,
                 connect: Connect = connect_actor) -> None:
        """`name`: prefix of the agents' names. `lend`: this memory tier's pool as lent over NIXL (blocks land in
        its slots); None: blocks are read through staging and handed to `store(keys, payloads, digests)`.
        `connect(source, staging_bytes, name)`: a client of the source's pool, made once per source."""
        self.name = name
        self._store, self._lend, self._connect = store, lend, connect
        self._peers: dict[str, RDMABackend] = {}
        self.pulled = 0  # blocks that arrived intact and were stored here

    def direct_reads(self) -> int:
        """Batches that landed straight in this tier's registered pool (no staging copy)."""
        return sum(p.stats()["extra"].get("direct_reads", 0) for p in self._peers.values())

    def pull(self, source: str, keys: list[bytes], staging_bytes: int) -> list[bool | None]:
        """Per key: True held here (arrived, or here already), False refused here, None missing or unreadable
        at the source (or the source is gone: every key None, and its client is made again next time)."""
        try:
            peer = self._peer(source, staging_bytes)
            if self._lend is not None:
                return self._land(peer, keys)
            got, verified = peer.read_verified([BlockKey(k) for k in keys])
        except (StorageError, ValueError):  # source gone or not NIXL-capable: nothing moved
            self._peers.pop(source, None)
            return [None] * len(keys)
        present = [i for i, g in enumerate(got) if g is not None]
        ok = self._store([keys[i] for i in present], [got[i] for i in present], [verified[i] for i in present])
        self.pulled += sum(ok)
        out: list[bool | None] = [None] * len(keys)
        for i, good in zip(present, ok):
            out[i] = good
        return out

    def _peer(self, source: str, staging_bytes: int) -> RDMABackend:
        peer = self._peers.get(source)
        if peer is None:
            peer = self._connect(source, staging_bytes, f"{self.name}-{len(self._peers)}")
            if self._lend is not None:
                peer.register(self._lend().pool)
            self._peers[source] = peer
        return peer

    def _land(self, peer: RDMABackend, keys: list[bytes]) -> list[bool | None]:
        """Reserve own slots, read the source's blocks into them, commit the ones that arrived intact."""
        pool = self._lend()
        held = [BlockKey(k) in pool.table for k in keys]  # already here: nothing to move
        fetch = [k for k, h in zip(keys, held) if not h]
        reserved = iter(pool.reserve(fetch, [pool.slot_bytes] * len(fetch)))
        slots = [None if h else next(reserved) for h in held]
        wanted = [i for i, slot in enumerate(slots) if slot is not None]
        host = pool.pool.numpy()
        results: list[np.ndarray | None] = [None] * len(wanted)
        try:
            digests = peer.read_into([BlockKey(keys[i]) for i in wanted], [host[slots[i]] for i in wanted], results)
        except BaseException:
            pool.cancel([keys[i] for i in wanted])
            raise
        arrived = [j for j, d in enumerate(digests) if d is not None]
        pool.cancel([keys[wanted[j]] for j, d in enumerate(digests) if d is None])
        pool.commit([keys[wanted[j]] for j in arrived], [slots[wanted[j]] for j in arrived],
                    [results[j].nbytes for j in arrived], [digests[j] for j in arrived])
        out: list[bool | None] = [True if h else False for h in held]  # no slot here: refused
        for j, i in enumerate(wanted):
            out[i] = True if digests[j] is not None else None
        self.pulled += len(arrived)
        return out
