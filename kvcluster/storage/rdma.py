"""The RDMA tier: a peer node's memory pool, read and written through NIXL.

The owner of a pool (`NixlPeerPool`, inside the peer's tier actor) registers its
slab with a NIXL agent and keeps the slot table. A client (`RDMABackend`) makes
one control call per batch (reserve / commit / lookup, over whatever channel
connects them: a Ray actor handle in the cluster, a pipe in tests) and moves the
bytes with one NIXL transfer per batch between the peer's slab and either memory
the caller registered (its own tier pool: no copy at all) or a registered
staging buffer (one copy). Metadata is exchanged once per peer. With UCX over
loopback (no RDMA NIC here) the same code runs over TCP/shared memory and says so.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Protocol, Sequence

import numpy as np
import torch

from ..keys import BlockKey
from .base import BackendStats, Payload, StorageBackend, StorageError, checksum
from .copyhash import copy_hash
from .parallel import BatchWorkers
from .slab import SlotTable


RESERVATION_TTL_S = 120.0  # a reserved slot nobody committed is free again after this (transfers give up at 30 s)


class PeerUnavailable(StorageError):
    """The pool's owner cannot be reached (its node left, its actor is restarting)."""


PIPELINE_GROUP_BYTES = 1 << 20  # a large direct read goes in transfers of about this size, verified while the next moves
PROGRESS_DELAY_US = 100  # default pause of an agent's progress thread between idle polls


def progress_delay_us() -> int:
    """Microseconds an agent's progress thread sleeps when idle (`KVCLUSTER_NIXL_PROGRESS_DELAY_US`, default 100).

    Why not NIXL's default: its Python API hard-codes 0, so every agent's progress thread
    polls without pause and spins one core at 100%, idle or not (measured here: two idle
    agents, 2.00 cores; with 100 us, 0.03 cores and the same 4 MiB transfer times). Every
    tier actor, replica and controller holds an agent. The thread itself must stay: UCX
    over TCP needs the target to progress, and a failed transfer's requests must be
    completed before its agent goes, or they leak and can crash the process at exit.
    0 restores NIXL's busy polling.
    """
    raw = os.environ.get("KVCLUSTER_NIXL_PROGRESS_DELAY_US", str(PROGRESS_DELAY_US)).strip()
    try:
        delay = int(raw)
    except ValueError:
        delay = -1
    if delay < 0:
        raise StorageError(f"KVCLUSTER_NIXL_PROGRESS_DELAY_US must be a whole number of microseconds >= 0, not {raw!r}")
    return delay


_AGENT_CONFIG_LOCK = threading.Lock()


def _agent(name: str):
    try:
        from nixl import _api
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise StorageError(f"rdma: NIXL is not importable: {exc}") from None
    if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent at INFO to stdout, breaking --json output
        logging.getLogger("nixl").setLevel(logging.WARNING)
    delay = progress_delay_us()
    config = nixl_agent_config(backends=["UCX"])
    bindings = getattr(_api, "nixlBind", None)
    base = getattr(bindings, "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):  # another NIXL layout: its own defaults
        return nixl_agent(name, config)

    class DelayedConfig(base):
        """nixl_agent sets pthrDelay = 0 while it builds its config; this keeps ours instead."""

        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _ignored: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, delay)

    with _AGENT_CONFIG_LOCK:  # the agent's constructor reads nixlBind.nixlAgentConfig: swap it for this call only
        bindings.nixlAgentConfig = DelayedConfig
        try:
            return nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = base


class PeerControl(Protocol):
    """What a client asks of a pool's owner; every call takes a whole batch."""

    def connect(self, client_metadata: bytes) -> tuple[bytes, bytes, int, str]: ...
    def reserve(self, keys: list[bytes], lengths: list[int]) -> list[int | None]: ...
    def commit(self, keys: list[bytes], slots: list[int], lengths: list[int], digests: list[int]) -> None: ...
    def lookup(self, keys: list[bytes]) -> list[tuple[int, int, int] | None]: ...
    def release(self, keys: list[bytes]) -> int: ...
    def usage(self) -> int: ...


class NixlPeerPool:
    """A host pool lent to other nodes: NIXL-registered slab + slot table (owner side)."""

    def __init__(self, slots: int, slot_bytes: int, name: str | None = None, *, pool: torch.Tensor | None = None,
                 table: SlotTable | None = None) -> None:
        """A new slab, or (`pool`, `table`) of an existing memory tier lent as they are (no copy)."""
        self.slot_bytes = slot_bytes
        self.pool = torch.zeros((slots, slot_bytes), dtype=torch.uint8) if pool is None else pool
        self.agent = _agent(name or f"kvc-pool-{uuid.uuid4().hex[:8]}")
        self.agent.register_memory(self.pool)
        self.table = SlotTable(slots) if table is None else table
        self._pending: dict[bytes, tuple[int, float]] = {}  # key -> (reserved slot, when it expires)

    def connect(self, client_metadata: bytes) -> tuple[bytes, bytes, int, str]:
        """Exchange metadata once: the client's agent learns this slab's address."""
        self.agent.add_remote_agent(client_metadata)
        descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs(self.pool))
        return self.agent.get_agent_metadata(), descs, self.slot_bytes, self.agent.name

    def reserve(self, keys: list[bytes], lengths: list[int], now: float | None = None) -> list[int | None]:
        now = time.monotonic() if now is None else now
        self._expire(now)
        slots = []
        for key, length in zip(keys, lengths):
            if length > self.slot_bytes:
                slots.append(None)
                continue
            self.table.release(BlockKey(key))  # an overwrite: the old copy stops being readable now
            self.cancel([key])  # an earlier reservation of this key that was never committed
            slot = self.table.allocate(BlockKey(key))  # a free slot, held only here until commit
            if slot is not None:
                self._pending[key] = (slot, now + RESERVATION_TTL_S)
            slots.append(slot)
        return slots

    def _expire(self, now: float) -> None:
        """Reservations of writers that died or gave up (their transfers time out long before) go back."""
        stale = [key for key, (_, until) in self._pending.items() if until <= now]
        self.cancel(stale)

    def cancel(self, keys: list[bytes]) -> None:
        """Give back reservations whose bytes never arrived."""
        for key in keys:
            held = self._pending.pop(key, None)
            if held is not None:
                self.table.abandon(held[0])

    def commit(self, keys: list[bytes], slots: list[int], lengths: list[int], digests: list[int]) -> None:
        for key, slot, length, digest in zip(keys, slots, lengths, digests):
            held = self._pending.get(key)
            if held is not None and held[0] == slot:  # an expired or superseded reservation commits nothing
                del self._pending[key]
                self.table.commit(BlockKey(key), slot, length, digest)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def lookup(self, keys: list[bytes]) -> list[tuple[int, int, int] | None]:
        entries = [self.table.get(BlockKey(k)) for k in keys]
        return [(e.slot, e.length, e.checksum) if e else None for e in entries]

    def release(self, keys: list[bytes]) -> int:
        return sum(self.table.release(BlockKey(k)) for k in keys)

    def put_local(self, keys: list[bytes], payloads: list[np.ndarray]) -> list[bool]:
        """The owner stores blocks into its own slab (they become readable by every peer)."""
        ok = []
        host = self.pool.numpy()
        for key, data in zip(keys, payloads):
            view = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
            slot = self.table.allocate(BlockKey(key)) if view.nbytes <= self.slot_bytes else None
            if slot is not None:
                self.table.commit(BlockKey(key), slot, view.nbytes, copy_hash(host[slot], view))
            ok.append(slot is not None)
        return ok

    def usage(self) -> int:
        """Bytes of slots holding committed blocks."""
        return len(self.table) * self.slot_bytes


def _groups(lengths: Sequence[int], target: int) -> list[range]:
    """Consecutive index ranges of about `target` bytes each (at least one block each)."""
    groups, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        used += n
        if used >= target:
            groups.append(range(start, i + 1))
            start, used = i + 1, 0
    if start < len(lengths):
        groups.append(range(start, len(lengths)))
    return groups


class RDMABackend(StorageBackend):
    """A peer's pool as a tier of this node (client side)."""

    name = "rdma"

    def __init__(self, peer: PeerControl, staging_bytes: int, slots: int, name: str | None = None) -> None:
        self.peer = peer
        self.agent = _agent(name or f"kvc-client-{uuid.uuid4().hex[:8]}")
        self.staging = torch.zeros(staging_bytes, dtype=torch.uint8)
        self.agent.register_memory(self.staging)
        self._stage_np = self.staging.numpy()
        meta, descs, self.slot_bytes, self.peer_name = peer.connect(self.agent.get_agent_metadata())
        if staging_bytes < self.slot_bytes:
            raise StorageError(f"rdma: a {staging_bytes}-byte staging buffer cannot hold one "
                               f"{self.slot_bytes}-byte block of {self.peer_name}")
        self.agent.add_remote_agent(meta)
        self._remote_base = self._remote_address(descs)
        self._slots = slots
        self._regions: list[tuple[int, int, torch.Tensor]] = []  # (start, end, tensor kept alive) registered here
        self.medium = "peer DRAM pool via NIXL UCX (loopback on this machine, no RDMA NIC)"
        self.emulated = True
        self._stats = BackendStats()
        self._workers = BatchWorkers()

    def register(self, region: torch.Tensor) -> None:
        """Register host memory the caller lands blocks in or sends them from (e.g. its own tier pool).

        Payloads and `out` buffers inside a registered region move straight between it and the peer's
        slab, without the staging copy. The caller keeps the region alive while this backend lives.
        """
        if region.device.type != "cpu" or not region.is_contiguous():
            raise StorageError("rdma: only contiguous host tensors can be registered")
        self.agent.register_memory(region)
        start = region.data_ptr()
        self._regions.append((start, start + region.numel() * region.element_size(), region))

    def _count(self, what: str) -> None:
        self._stats.extra[what] = self._stats.extra.get(what, 0) + 1

    def _registered(self, arrays: Sequence[np.ndarray], lengths: Sequence[int]) -> list[int] | None:
        """Each array's address when all of them lie (contiguous, long enough) inside registered memory."""
        if not self._regions:
            return None
        addrs = []
        for a, n in zip(arrays, lengths):
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or a.nbytes < n:
                return None
            addr = a.__array_interface__["data"][0]
            if not any(lo <= addr and addr + n <= hi for lo, hi, _ in self._regions):
                return None
            addrs.append(addr)
        return addrs

    def _remote_address(self, descs: bytes) -> int:
        remote = self.agent.deserialize_descs(descs)
        return int(remote[0][0]) if hasattr(remote, "__getitem__") else 0

    def _transfer(self, op: str, local: list[tuple[int, int]], remote_slots: list[int]) -> None:
        """One NIXL transfer for the whole batch: local (address, length) <-> remote slots.

        Any NIXL failure (the peer process restarted or left: NIXL_ERR_REMOTE_DISCONNECT, a bad
        descriptor, a transfer in ERR, no answer in 30 s) is a StorageError: the caller's misses."""
        try:
            local_descs = self.agent.get_xfer_descs([(addr, n, 0) for addr, n in local], "DRAM")
            remote_descs = self.agent.get_xfer_descs(
                [(self._remote_base + s * self.slot_bytes, n, 0) for s, (_, n) in zip(remote_slots, local)], "DRAM")
            handle = self.agent.initialize_xfer(op, local_descs, remote_descs, self.peer_name)
        except Exception as exc:  # noqa: BLE001 - NIXL's errors share no base class we could name
            raise StorageError(f"rdma: NIXL {op} could not start: {type(exc).__name__}: {exc}") from None
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + 30
            while state != "DONE":
                if state == "ERR" or time.monotonic() > deadline:
                    raise StorageError(f"rdma: NIXL {op} failed ({state})")
                state = self.agent.check_xfer_state(handle)
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise StorageError(f"rdma: NIXL {op} failed: {type(exc).__name__}: {exc}") from None
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a handle of a vanished peer may not release cleanly
                pass

    def _read_direct(self, found: list[int], entries: list, addrs: list[int],
                     out: Sequence[np.ndarray]) -> list[tuple[int, np.ndarray, bool]]:
        """Blocks read straight into registered `out` buffers: (index, data, checksum matches) per block.

        A large batch goes in a few transfers, each group's checksums verified on another core
        while the next group is on the wire. A failed transfer raises StorageError once the
        checks in flight are over (they read `out`, which the caller may reuse)."""
        lengths = [entries[i][1] for i in found]
        background = self._workers.worth(sum(lengths))
        checks = []

        def verify(part: range) -> list[tuple[int, np.ndarray, bool]]:
            landed = [(found[k], out[found[k]][: lengths[k]]) for k in part]
            return [(i, data, checksum(data) == entries[i][2]) for i, data in landed]

        for part in _groups(lengths, PIPELINE_GROUP_BYTES if background else sum(lengths)):
            try:
                self._transfer("READ", [(addrs[k], lengths[k]) for k in part], [entries[found[k]][0] for k in part])
            except StorageError:
                for check in checks:
                    check()
                raise
            checks.append(self._workers.start(background, verify, part))
        return [landed for check in checks for landed in check()]

    def _batches(self, lengths: Sequence[int]):
        """Split a batch so each part fits in the staging buffer."""
        start, used = 0, 0
        for i, n in enumerate(lengths):
            if used + n > self.staging.numel() and i > start:
                yield start, i
                start, used = i, 0
            used += n
        if start < len(lengths):
            yield start, len(lengths)

    def put_many(self, items: Sequence[tuple[BlockKey, Payload]]) -> list[bool]:
        views = [np.frombuffer(memoryview(d).cast("B"), dtype=np.uint8) for _, d in items]
        keys = [bytes(k) for k, _ in items]
        direct = self._registered(views, [v.nbytes for v in views])
        if direct is not None:
            ok = self._put_direct(keys, views, direct)
        else:
            ok = self._put_staged(keys, views)
        self._stats.puts += sum(ok)
        self._stats.put_failures += len(ok) - sum(ok)
        self._stats.put_bytes += sum(v.nbytes for v, good in zip(views, ok) if good)
        return ok

    def _put_direct(self, keys: list[bytes], views: list[np.ndarray], addrs: list[int]) -> list[bool]:
        """Registered payloads: one reserve, one NIXL write straight from them, one commit.

        The digests are summed on another core while the write is under way."""
        ok = [False] * len(keys)
        digests = self._workers.ahead(checksum, views, sum(v.nbytes for v in views))
        try:
            slots = self.peer.reserve(keys, [v.nbytes for v in views])
            picked = [i for i, s in enumerate(slots) if s is not None]
            if picked:
                self._transfer("WRITE", [(addrs[i], views[i].nbytes) for i in picked], [slots[i] for i in picked])
                self._count("direct_writes")
                self.peer.commit([keys[i] for i in picked], [slots[i] for i in picked],
                                 [views[i].nbytes for i in picked], [digests[i]() for i in picked])
        except StorageError:  # peer gone (PeerUnavailable) or the write failed: nothing of this batch is stored
            return ok
        for i in picked:
            ok[i] = True
        return ok

    def _put_staged(self, keys: list[bytes], views: list[np.ndarray]) -> list[bool]:
        ok = [False] * len(keys)
        base = self.staging.data_ptr()
        for lo, hi in self._batches([v.nbytes for v in views]):
            try:
                slots = self.peer.reserve(keys[lo:hi], [v.nbytes for v in views[lo:hi]])
            except PeerUnavailable:
                break
            picked = [i for i, s in zip(range(lo, hi), slots) if s is not None]
            local, digests, off = [], [], 0
            for i in picked:
                digests.append(copy_hash(self._stage_np[off : off + views[i].nbytes], views[i]))
                local.append((base + off, views[i].nbytes))
                off += views[i].nbytes
            if picked:
                try:
                    self._transfer("WRITE", local, [slots[i - lo] for i in picked])
                    self.peer.commit([keys[i] for i in picked], [slots[i - lo] for i in picked],
                                     [views[i].nbytes for i in picked], digests)
                except StorageError:  # peer gone mid-batch: these blocks are not stored (uncommitted slots are never read)
                    break
            for i in picked:
                ok[i] = True
        return ok

    def get_many(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray | None]:
        results: list[np.ndarray | None] = [None] * len(keys)
        landed = self.read_into(keys, out, results)
        return [r if d is not None else None for r, d in zip(results, landed)]

    def read_into(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None,
                  results: list[np.ndarray | None], raise_unavailable: bool = False) -> list[int | None]:
        """Read blocks into `out` (or new arrays); `results[i]` gets the block, the return its verified checksum.

        When every `out` buffer lies in registered memory the peer's bytes land there directly (one NIXL
        read, checksums verified in place); otherwise they pass through the staging buffer.
        None: missing at the peer, unreachable, or corrupt (then dropped at the peer too).
        `raise_unavailable`: an unreachable peer or a failed transfer raises (PeerUnavailable /
        StorageError) instead of reading as all misses, for callers that tell a fault from a miss.
        """
        digests: list[int | None] = [None] * len(keys)
        try:
            entries = self.peer.lookup([bytes(k) for k in keys])
        except PeerUnavailable:  # the peer's memory is gone or unreachable: all misses
            self._stats.misses += len(keys)
            if raise_unavailable:
                raise
            return digests
        found = [i for i, e in enumerate(entries) if e is not None]
        self._stats.misses += len(keys) - len(found)
        if not found:
            return digests
        lengths = [entries[i][1] for i in found]
        direct = None if out is None else self._registered([out[i] for i in found], lengths)
        corrupt = []
        if direct is not None:
            try:
                landed = self._read_direct(found, entries, direct, out)
            except StorageError:  # peer gone between lookup and read: all misses
                self._stats.misses += len(found)
                if raise_unavailable:
                    raise
                return digests
            self._count("direct_reads")
        else:
            landed = []
            base = self.staging.data_ptr()
            for lo, hi in self._batches(lengths):
                part = found[lo:hi]
                local, off = [], 0
                for i in part:
                    local.append((base + off, entries[i][1]))
                    off += entries[i][1]
                try:
                    self._transfer("READ", local, [entries[i][0] for i in part])
                except StorageError:  # peer gone between lookup and read: the rest are misses
                    self._stats.misses += len(found) - lo
                    if raise_unavailable:
                        raise
                    break
                for i, (addr, n) in zip(part, local):
                    dst = out[i][:n] if out is not None else np.empty(n, dtype=np.uint8)
                    if copy_hash(dst, self._stage_np[addr - base : addr - base + n]) != entries[i][2]:
                        corrupt.append(i)  # what landed in `out[i]` is not handed out: a miss
                        continue
                    results[i] = dst
                    digests[i] = entries[i][2]
        for i, data, intact in landed:
            if not intact:
                corrupt.append(i)
            else:
                results[i], digests[i] = data, entries[i][2]
        good = [i for i in found if digests[i] is not None]
        self._stats.gets += len(good)
        self._stats.get_bytes += sum(entries[i][1] for i in good)
        if corrupt:
            self._stats.corrupt += len(corrupt)
            try:
                self.peer.release([bytes(keys[i]) for i in corrupt])
            except PeerUnavailable:
                pass  # the peer's memory is gone anyway
        return digests

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        try:
            return [e is not None for e in self.peer.lookup([bytes(k) for k in keys])]
        except PeerUnavailable:
            return [False] * len(keys)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        n = self.peer.release([bytes(k) for k in keys])
        self._stats.deletes += n
        return n

    @property
    def used_bytes(self) -> int:
        return self.peer.usage()

    @property
    def capacity_bytes(self) -> int:
        return self._slots * self.slot_bytes

    def stats(self) -> dict:
        return {"name": self.name, "medium": self.medium, "emulated": self.emulated, "peer": self.peer_name,
                "capacity_bytes": self.capacity_bytes, **self._stats.__dict__}

    def check_integrity(self) -> None:
        assert self.staging.numel() > 0 and self._remote_base > 0
