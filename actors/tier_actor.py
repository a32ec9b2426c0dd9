"""One memory tier of one node as a Ray actor: it hosts one storage backend and serves batched put/get/delete.

Named `kvcluster/<node>/<tier>`, pinned to its node, restarted on failure. A
restart comes back empty for memory tiers (their blocks become misses, and the
index is told); the nvme and pfs tiers reopen their directory.

Each other role has one owner the actor delegates to: `IndexReporter` tells the
index what was stored and dropped (one fire-and-forget call per batch),
`TierMetrics` records lookups, faults and bytes, `PrefetchTracker` follows
promoted blocks until read or deleted, `PeerServer` lends a memory tier's slab
and slot table to other nodes over NIXL (`connect`/`lookup`/`reserve`/`commit`/
`release`/`usage`), and `NixlPuller` copies blocks from another node's memory tier
into this one (`pull`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvcluster import storage  # the memory tiers' names load torch on first use: file tiers never do
from kvcluster.keys import BlockKey
from kvcluster.storage import NVMeBackend, PFSBackend
from kvcluster.tiers import NODE_TIERS, TierSpec, check_tiers, format_size

from .index_actor import NAMESPACE
from .index_client import IndexClient
from .index_reporter import IndexReporter
from .nixl_pull import NixlPuller
from .peer_server import MEMORY_TIERS, PeerServer
from .prefetch import PrefetchTracker
from .tier_metrics import TierMetrics

if TYPE_CHECKING:
    from kvcluster.storage import NixlPeerPool


class TierActorConfig(BaseModel):
    """One tier actor: its node and its tier, written as every tier is (`kvcluster.tiers.TierSpec`: kind,
    capacity with its unit, path), in blocks of `slot_bytes`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str = Field(description="Node name used in actor names and the index.")
    tier: TierSpec = Field(description="The tier as a node's tiers are written; a kind a node's tier actor runs "
                                       "(kvcluster.tiers.NODE_TIERS: hbm stays inside the model replica). It holds "
                                       "capacity x usable_fraction // slot_bytes blocks.")
    slot_bytes: int = Field(gt=0, description="Bytes per block payload.")

    @field_validator("tier")
    @classmethod
    def _actor_kind(cls, tier: TierSpec) -> TierSpec:
        check_tiers([tier], NODE_TIERS, "a node's tier actor")
        return tier

    @model_validator(mode="after")
    def _holds_a_block(self) -> "TierActorConfig":
        if self.slots < 1:
            raise ValueError(f"tier {self.kind}: field capacity: {format_size(self.tier.usable_bytes)} usable "
                             f"holds no {self.slot_bytes}-byte block")
        return self

    @classmethod
    def of(cls, node: str, kind: str, slots: int, slot_bytes: int, path: str | None = None) -> "TierActorConfig":
        """A tier of exactly `slots` blocks of `slot_bytes` (benchmarks, tests, a live replay's capacities)."""
        return cls(node=node, tier=TierSpec(kind=kind, capacity=format_size(slots * slot_bytes), path=path),
                   slot_bytes=slot_bytes)

    @property
    def kind(self) -> str:
        return self.tier.kind

    @property
    def path(self) -> str | None:
        return self.tier.path

    @property
    def slots(self) -> int:
        """Blocks the tier holds (pfs: its capacity in blocks)."""
        return self.tier.usable_bytes // self.slot_bytes


def actor_name(node: str, tier: str) -> str:
    return f"kvcluster/{node}/{tier}"


def _backend(cfg: TierActorConfig):
    if cfg.kind == "dram":
        return storage.dram_backend(cfg.slots, cfg.slot_bytes)
    if cfg.kind == "cxl":
        return storage.cxl_backend(cfg.slots, cfg.slot_bytes)
    if cfg.path is None:
        raise ValueError(f"the {cfg.kind} tier needs a path")
    if cfg.kind == "nvme":
        return NVMeBackend(Path(cfg.path) / cfg.node, cfg.slots, cfg.slot_bytes)
    return PFSBackend(cfg.path, cfg.slots * cfg.slot_bytes)


def _pick(values: list | None, positions: list[int]) -> list | None:
    """`values` at `positions` (an optional per-key argument follows its keys)."""
    return None if values is None else [values[i] for i in positions]


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class TierActor(PeerServer):
    def __init__(self, config: dict) -> None:
        self.cfg = TierActorConfig.model_validate(config)
        self.backend = _backend(self.cfg)
        self.reporter = IndexReporter(IndexClient.connect(), self.cfg.node, self.cfg.kind)
        self.metrics = TierMetrics(self.cfg.node, self.cfg.kind)
        self.prefetched = PrefetchTracker()
        self._nixl: NixlPeerPool | None = None
        self.puller = NixlPuller(f"kvc-pull-{self.cfg.node}-{self.cfg.kind}", self._write,
                                 self._lend if self.cfg.kind in MEMORY_TIERS else None)
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.metrics.fault("restarted")
            self._tell_control_plane()
        if self.cfg.kind != "pfs":  # a fresh process holds nothing: what the index thought it had is gone
            self.reporter.lost()
        else:  # the shared filesystem outlives processes and clusters: tell the index what is already there
            self.reporter.listed(self.backend.keys())

    def _tell_control_plane(self) -> None:
        """After a restart this tier holds what its backend kept (nothing, for a memory tier): its node's
        controller re-reads it, so it neither counts on blocks that are gone nor leaves new ones unaccounted."""
        from .node_control_actor import control_handle

        try:
            control = control_handle(self.cfg.node)
        except (ValueError, ray.exceptions.RayError):  # no controller (a tier used on its own): nothing to tell
            return
        control.resync.remote(actor_name(self.cfg.node, self.cfg.kind))

    # ---- the backend: batched put / get / delete ---------------------------------------------------------

    def put_many(self, keys: list[bytes], payloads: list[np.ndarray], pairs: list[int] | None = None,
                 prefetch: bool = False, digests: list[int | None] | None = None,
                 evict: list[bytes] | None = None) -> list[bool]:
        """Store blocks; `prefetch`: the caller promoted them here ahead of use (tracked until read or
        deleted); `digests`: the checksums the tier they were read from verified (see
        `StorageBackend.put_many`); `evict`: blocks the node's controller let go from this tier, deleted
        first in the same call (the room these take). In a cluster the node's controller decided the room,
        and the writer (an engine with new blocks) tells it which puts were refused."""
        if evict:
            self.delete(evict)
        ok = self._write(keys, payloads, digests)
        self._stored(keys, ok, pairs, prefetch)
        return ok

    def put_read(self, keys: list[bytes], read: tuple[list[np.ndarray | None], list[int | None]],
                 evict: list[bytes] | None = None) -> list[bool]:
        """Blocks another tier actor of this node read (`read_verified`'s answer, passed by the node
        controller as an object reference and resolved here): a move whose bytes never pass through the
        controller. A block the source could not read is refused (False). `evict`: as for `put_many`."""
        if evict:
            self.delete(evict)
        payloads, digests = read
        present = [i for i, p in enumerate(payloads) if p is not None]
        ok = [False] * len(keys)
        if present:
            stored = self.put_many(_pick(keys, present), _pick(payloads, present), None, False,
                                   _pick(digests, present))
            for i, good in zip(present, stored):
                ok[i] = good
        return ok

    def _write(self, keys: list[bytes], payloads: list[np.ndarray], digests: list[int | None] | None) -> list[bool]:
        """Blocks into the backend; per key whether it took them. Puts and staged pulls both come here (a pull
        into a memory tier lands in reserved slots instead)."""
        return self.backend.put_many(list(zip(keys, payloads)), digests)

    def get_many(self, keys: list[bytes]) -> list[np.ndarray | None]:
        return self.read_verified(keys)[0]

    def read_verified(self, keys: list[bytes]) -> tuple[list[np.ndarray | None], list[int | None]]:
        """`get_many`'s payloads and the digests they were verified against: a move hands both to `put_many`
        of the tier they go to, which then catches bytes changed on the way (the object store's copy too)."""
        corrupt_before = self.backend.stats().get("corrupt", 0)
        got, digests = self.backend.read_verified([BlockKey(k) for k in keys])
        corrupt = self.backend.stats().get("corrupt", 0) - corrupt_before
        self._read(keys, [g is not None for g in got], corrupt)
        return got, digests

    def delete(self, keys: list[bytes]) -> int:
        self.metrics.prefetch("wasted", self.prefetched.dropped(keys))
        n = self.backend.delete(keys)
        self.reporter.removed(keys)
        self.metrics.occupancy(self.backend)
        return n

    # ---- what follows a put or a read: index, prefetch tracking, metrics -------------------------------------

    def _stored(self, keys: list[bytes], ok: list[bool], pairs: list[int] | None, prefetch: bool) -> None:
        """Blocks arrived here (`ok`) or were refused."""
        kept = [i for i, good in enumerate(ok) if good]
        stored = _pick(keys, kept)
        if prefetch:
            self.prefetched.promoted(stored)
        self.reporter.stored(stored, _pick(pairs, kept))
        self.metrics.fault("put_refused", len(keys) - len(stored))
        self.metrics.occupancy(self.backend)

    def _read(self, keys: list[bytes], found: list[bool], corrupt: int) -> None:
        """Blocks were read here, or looked up by a NIXL reader (who reads them next); `corrupt` of the
        ones not found were dropped for a failed checksum."""
        missing = [k for k, f in zip(keys, found) if not f]
        self.reporter.removed(missing)  # missing or corrupt here: make sure nobody is sent here for it again
        self.metrics.prefetch("hit", self.prefetched.read(k for k, f in zip(keys, found) if f))
        self.metrics.reads(len(keys), len(missing), corrupt)
        if corrupt:
            self.metrics.occupancy(self.backend)

    # ---- NIXL: this tier's pool lent to other nodes (PeerServer), and pulls from theirs (NixlPuller) ----------

    def _lend(self) -> NixlPeerPool:
        """The slab and slot table this tier serves from, lent as they are (no copy), made on first use."""
        if self.cfg.kind not in MEMORY_TIERS:
            raise ValueError(f"the {self.cfg.kind} tier is not a memory pool other nodes can read over NIXL")
        if self._nixl is None:
            self._nixl = storage.NixlPeerPool(self.cfg.slots, self.cfg.slot_bytes,
                                              name=f"kvc-{self.cfg.node}-{self.cfg.kind}",
                                              pool=self.backend.pool, table=self.backend.table)
        return self._nixl

    def _looked_up(self, keys: list[bytes], entries: list[tuple[int, int, int] | None]) -> None:
        self._read(keys, [e is not None for e in entries], 0)  # counted as this tier's reads

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
        out = self.puller.pull(source, keys, staging_bytes)
        done = [i for i, o in enumerate(out) if o is not None]
        self._stored(_pick(keys, done), [bool(out[i]) for i in done], _pick(pairs, done), prefetch)
        return out

    # ---- reports -------------------------------------------------------------------------------------------

    def held_keys(self) -> list[bytes]:
        """Every block this tier holds, for a control plane rebuilding its view after a restart."""
        return list(self.backend.keys())

    def stats(self) -> dict:
        return {**self.backend.stats(), "nixl_pulled_blocks": self.puller.pulled,
                "nixl_direct_reads": self.puller.direct_reads(), "prefetched_unread": len(self.prefetched)}

    def describe(self) -> dict:
        """Where this tier is, how many blocks it can hold and holds (`kvcluster cluster status`)."""
        self.metrics.occupancy(self.backend)
        return {"node": self.cfg.node, "tier": self.cfg.kind, "slot_bytes": self.cfg.slot_bytes,
                "capacity_blocks": self.backend.capacity_bytes // self.cfg.slot_bytes,
                "used_blocks": self.backend.used_bytes // self.cfg.slot_bytes,
                "pid": os.getpid()}  # changes when the actor restarts: its memory tier came back empty
