"""One memory tier of one node as a Ray actor: it contains one storage backend.

Named `kvcluster/<node>/<tier>`, pinned to its node, restarted on failure. A
restart comes back empty for memory tiers (their blocks become misses, and the
index is told); the nvme and pfs tiers reopen their directory. Every put and
delete is reported to the index actor in one batched, fire-and-forget call.

Memory tiers (dram, cxl) also lend their pool to other nodes over NIXL: the
`connect`/`lookup`/`reserve`/`commit`/`release`/`usage` batch calls are the rdma
peer protocol, served from the very slab and slot table the tier uses. `pull`
copies blocks from another node's memory tier into this one: one control call to
the source, then the bytes move node to node in one NIXL read per batch, landing
directly in this tier's own slots.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import ray
from pydantic import BaseModel, ConfigDict, Field

from kvcluster.keys import BlockKey
from kvcluster.storage import NixlPeerPool, NVMeBackend, PFSBackend, RDMABackend, StorageError, cxl_backend, dram_backend

from . import metrics
from .index_actor import INDEX_NAME, NAMESPACE


class TierActorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str = Field(description="Node name used in actor names and the index.")
    tier: str = Field(pattern="^(dram|cxl|nvme|pfs)$", description="hbm stays inside the model replica.")
    slots: int = Field(gt=0, description="Blocks the tier holds (pfs: capacity in blocks).")
    slot_bytes: int = Field(gt=0, description="Bytes per block payload.")
    path: str | None = Field(None, description="Directory for nvme and pfs.")
    overflow: str | None = Field(None, description="Actor name of the next tier down on this node: new blocks "
                                 "this tier has no room for go there instead of being dropped.")


def actor_name(node: str, tier: str) -> str:
    return f"kvcluster/{node}/{tier}"


def _backend(cfg: TierActorConfig):
    if cfg.tier == "dram":
        return dram_backend(cfg.slots, cfg.slot_bytes)
    if cfg.tier == "cxl":
        return cxl_backend(cfg.slots, cfg.slot_bytes)
    if cfg.path is None:
        raise ValueError(f"the {cfg.tier} tier needs a path")
    if cfg.tier == "nvme":
        return NVMeBackend(Path(cfg.path) / cfg.node, cfg.slots, cfg.slot_bytes)
    return PFSBackend(cfg.path, cfg.slots * cfg.slot_bytes)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class TierActor:
    def __init__(self, config: dict) -> None:
        self.cfg = TierActorConfig.model_validate(config)
        self.backend = _backend(self.cfg)
        self.index = ray.get_actor(INDEX_NAME, namespace=NAMESPACE)
        self._nixl: NixlPeerPool | None = None
        self._peers: dict[str, RDMABackend] = {}
        self._pulled = 0
        self._prefetched: set[bytes] = set()  # promoted here by the placement controller, not read yet
        if ray.get_runtime_context().was_current_actor_reconstructed:
            metrics.faults().inc(1, {"component": self._where, "kind": "restarted"})
        if self.cfg.tier != "pfs":  # a fresh process holds nothing: what the index thought it had is gone
            self.index.lost.remote(self.cfg.node, self.cfg.tier)
        else:  # the shared filesystem outlives processes and clusters: tell the index what is already there
            held = self.backend.keys()
            for i in range(0, len(held), 4096):
                self.index.stored.remote(self.cfg.node, "pfs", held[i : i + 4096])

    def put_many(self, keys: list[bytes], payloads: list[np.ndarray], pairs: list[int] | None = None,
                 prefetch: bool = False, digests: list[int | None] | None = None,
                 overflow: bool = False) -> list[bool]:
        """Store blocks; `prefetch`: the placement controller promoted them here ahead of use; `digests`:
        the checksums the tier they were read from verified (see `StorageBackend.put_many`).

        `overflow`: blocks this tier refuses (full until the next placement round) are handed to the
        next tier down on this node in one fire-and-forget call, which may hand them on in turn. Why:
        a replica's write-through is its only copy beyond its own hbm, and a burst of new blocks
        larger than the room between high water and full would otherwise be lost. A mover (the
        placement controller) passes False: it keeps its source when a put is refused."""
        ok = self.backend.put_many(list(zip(keys, payloads)), digests)
        self._stored(keys, ok, pairs, prefetch)
        refused = [i for i, good in enumerate(ok) if not good]
        if overflow and refused and self.cfg.overflow is not None:
            self._overflow([keys[i] for i in refused], [payloads[i] for i in refused],
                           None if pairs is None else [pairs[i] for i in refused],
                           None if digests is None else [digests[i] for i in refused])
        return ok

    def _overflow(self, keys: list[bytes], payloads: list[np.ndarray], pairs: list[int] | None,
                  digests: list[int | None] | None) -> None:
        try:
            below = ray.get_actor(self.cfg.overflow, namespace=NAMESPACE)
        except ValueError:  # the tier below is gone: these blocks stay misses
            metrics.faults().inc(len(keys), {"component": self._where, "kind": "overflow_lost"})
            return
        below.put_many.remote(keys, payloads, pairs, False, digests, True)
        metrics.overflows().inc(len(keys), {"node": self.cfg.node, "tier": self.cfg.tier})

    def _stored(self, keys: list[bytes], ok: list[bool], pairs: list[int] | None, prefetch: bool) -> None:
        """Tell the index (one call), count refusals, track prefetches, report bytes."""
        stored = [k for k, good in zip(keys, ok) if good]
        if prefetch:
            self._prefetched.update(stored)
        if stored:
            kept = None if pairs is None else [p for p, good in zip(pairs, ok) if good]
            self.index.stored.remote(self.cfg.node, self.cfg.tier, stored, kept)
        if len(stored) < len(keys):
            metrics.faults().inc(len(keys) - len(stored), {"component": self._where, "kind": "put_refused"})
        self._report_bytes()

    def get_many(self, keys: list[bytes]) -> list[np.ndarray | None]:
        return self.read_verified(keys)[0]

    def read_verified(self, keys: list[bytes]) -> tuple[list[np.ndarray | None], list[int | None]]:
        """`get_many`'s payloads and the digests they were verified against: a move hands both to `put_many`
        of the tier they go to, which then catches bytes changed on the way (the object store's copy too)."""
        corrupt_before = self.backend.stats().get("corrupt", 0)
        got, digests = self.backend.read_verified([BlockKey(k) for k in keys])
        corrupt = self.backend.stats().get("corrupt", 0) - corrupt_before
        self._account_reads(keys, [g is not None for g in got], corrupt)
        return got, digests

    def _account_reads(self, keys: list[bytes], found: list[bool], corrupt: int) -> None:
        """After a read (here, or by a NIXL reader that looked the keys up): index, prefetch and lookup metrics."""
        bad = [k for k, f in zip(keys, found) if not f]
        if bad:  # missing or corrupt here: make sure nobody is sent here for it again
            self.index.removed.remote(self.cfg.node, self.cfg.tier, bad)
        if self._prefetched:
            used = [k for k, f in zip(keys, found) if f and k in self._prefetched]
            if used:
                self._prefetched.difference_update(used)
                metrics.prefetches().inc(len(used), {"outcome": "hit"})
        tags = {"node": self.cfg.node, "tier": self.cfg.tier}
        if len(keys) > len(bad):
            metrics.tier_lookups().inc(len(keys) - len(bad), {**tags, "outcome": "hit"})
        if len(bad) > corrupt:
            metrics.tier_lookups().inc(len(bad) - corrupt, {**tags, "outcome": "miss"})
        if corrupt:
            metrics.tier_lookups().inc(corrupt, {**tags, "outcome": "corrupt"})
            metrics.faults().inc(corrupt, {"component": self._where, "kind": "corrupt"})
            self._report_bytes()

    def delete(self, keys: list[bytes]) -> int:
        if self._prefetched:
            unread = [k for k in keys if k in self._prefetched]
            if unread:
                self._prefetched.difference_update(unread)
                metrics.prefetches().inc(len(unread), {"outcome": "wasted"})
        n = self.backend.delete(keys)
        self.index.removed.remote(self.cfg.node, self.cfg.tier, keys)
        self._report_bytes()
        return n

    @property
    def _where(self) -> str:
        return f"{self.cfg.node}/{self.cfg.tier}"

    def _report_bytes(self) -> None:
        tags = {"node": self.cfg.node, "tier": self.cfg.tier}
        metrics.tier_bytes().set(self.backend.used_bytes, {**tags, "kind": "used"})
        metrics.tier_bytes().set(self.backend.capacity_bytes, {**tags, "kind": "capacity"})

    def stats(self) -> dict:
        direct = sum(p.stats()["extra"].get("direct_reads", 0) for p in self._peers.values())
        return {**self.backend.stats(), "nixl_pulled_blocks": self._pulled, "nixl_direct_reads": direct,
                "prefetched_unread": len(self._prefetched)}

    # ---- NIXL: this tier's pool as a peer of other nodes -------------------------------------------------

    def _export(self) -> NixlPeerPool:
        if self.cfg.tier not in ("dram", "cxl"):
            raise ValueError(f"the {self.cfg.tier} tier is not a memory pool other nodes can read over NIXL")
        if self._nixl is None:
            self._nixl = NixlPeerPool(self.cfg.slots, self.cfg.slot_bytes, name=f"kvc-{self.cfg.node}-{self.cfg.tier}",
                                      pool=self.backend.pool, table=self.backend.table)
        return self._nixl

    def connect(self, client_metadata: bytes):
        return self._export().connect(client_metadata)

    def lookup(self, keys: list[bytes]):
        """Where a NIXL reader finds `keys` in this slab; counted as this tier's reads (it reads them next)."""
        entries = self._export().lookup(keys)
        self._account_reads(keys, [e is not None for e in entries], 0)
        return entries

    def reserve(self, keys: list[bytes], lengths: list[int]):
        return self._export().reserve(keys, lengths)

    def commit(self, keys: list[bytes], slots: list[int], lengths: list[int], digests: list[int]) -> None:
        self._export().commit(keys, slots, lengths, digests)
        self.index.stored.remote(self.cfg.node, self.cfg.tier, keys)

    def release(self, keys: list[bytes]) -> int:
        return self.delete(keys)

    def usage(self) -> int:
        return self.backend.used_bytes

    def pull(self, source: str, keys: list[bytes], pairs: list[int] | None = None, prefetch: bool = False,
             staging_bytes: int = 64 << 20) -> list[bool | None]:
        """Copy `keys` from the memory tier actor named `source` (another node) into this tier over NIXL.

        A memory tier lands the bytes straight in its own slots (its pool is registered with the pull's
        NIXL agent: one read, one checksum pass, no copy); nvme/pfs go through staging and a put.
        Per key: True stored here, False refused here, None missing or unreadable at the source.
        """
        from .peer_pool_actor import ActorPeerControl

        try:
            peer = self._peers.get(source)
            if peer is None:
                handle = ray.get_actor(source, namespace=NAMESPACE)
                peer = RDMABackend(ActorPeerControl(handle, timeout_s=30), staging_bytes, 1,
                                   name=f"kvc-pull-{self.cfg.node}-{self.cfg.tier}-{len(self._peers)}")
                if self.cfg.tier in ("dram", "cxl"):
                    peer.register(self.backend.pool)
                self._peers[source] = peer
            if self.cfg.tier in ("dram", "cxl"):
                return self._land(peer, keys, pairs, prefetch)
            got, verified = peer.read_verified([BlockKey(k) for k in keys])
        except (StorageError, ValueError):  # source gone or not NIXL-capable: nothing moved
            self._peers.pop(source, None)
            return [None] * len(keys)
        present = [i for i, g in enumerate(got) if g is not None]
        ok = self.put_many([keys[i] for i in present], [got[i] for i in present],
                           None if pairs is None else [pairs[i] for i in present], prefetch,
                           [verified[i] for i in present])
        self._pulled += sum(ok)
        out: list[bool | None] = [None] * len(keys)
        for i, good in zip(present, ok):
            out[i] = good
        return out

    def _land(self, peer: RDMABackend, keys: list[bytes], pairs: list[int] | None,
              prefetch: bool) -> list[bool | None]:
        """Reserve own slots, read the source's blocks into them, commit the ones that arrived intact."""
        pool = self._export()
        held = [BlockKey(k) in self.backend.table for k in keys]  # already here: nothing to move
        fetch = [k for k, h in zip(keys, held) if not h]
        reserved = iter(pool.reserve(fetch, [self.cfg.slot_bytes] * len(fetch)))
        slots = [None if h else next(reserved) for h in held]
        wanted = [i for i, slot in enumerate(slots) if slot is not None]
        host = self.backend.pool.numpy()
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
        done = [i for i in range(len(keys)) if out[i] is not None]
        self._stored([keys[i] for i in done], [bool(out[i]) for i in done],
                     None if pairs is None else [pairs[i] for i in done], prefetch)
        self._pulled += len(arrived)
        return out

    def describe(self) -> dict:
        """Where this tier is and how many blocks it can hold (the placement controller's capacity)."""
        self._report_bytes()
        return {"node": self.cfg.node, "tier": self.cfg.tier, "slot_bytes": self.cfg.slot_bytes,
                "capacity_blocks": self.backend.capacity_bytes // self.cfg.slot_bytes,
                "used_blocks": self.backend.used_bytes // self.cfg.slot_bytes,
                "pid": os.getpid()}  # changes when the actor restarts: its memory tier came back empty
