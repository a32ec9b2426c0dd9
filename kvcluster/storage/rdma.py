"""The RDMA tier: a peer node's memory pool, read and written through NIXL.

The owner of a pool (`NixlPeerPool`, inside the peer's tier actor) registers its
slab with a NIXL agent and keeps the slot table. A client (`RDMABackend`) makes
one control call per batch (reserve / commit / lookup, over whatever channel
connects them: a Ray actor handle in the cluster, a pipe in tests) and moves the
bytes with one NIXL transfer per batch between the peer's slab and either memory
the caller registered (its own tier pool: no copy at all) or a registered
staging buffer (one copy). Metadata is exchanged once per peer. Where the host
has no RDMA device UCX moves the same transfers over TCP or shared memory, and the
backend's `medium` and `emulated` say which (`ucx_transport`).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from ..keys import BlockKey
from .aligned import aligned_empty
from .base import (BackendStats, Payload, PeerUnavailable, StorageBackend, StorageError, checksum, given_digests,
                   host_bytes)
from .copyhash import copy_hash, hash_in_background, hash_segments, tensor_hashes
from .parallel import BatchWorkers, default_workers
from .slab import SlotTable


RDMA_DEVICES = Path("/sys/class/infiniband")  # InfiniBand and RoCE adapters, as the kernel lists them


def ucx_transport(devices_dir: Path = RDMA_DEVICES) -> tuple[str, bool]:
    """What UCX can move a peer's bytes over on this host, and whether that only stands in for RDMA.

    UCX picks its transports itself (`UCX_TLS` narrows them): RDMA verbs when the host has an RDMA
    adapter, else TCP between hosts and shared memory within one. NIXL does not report the pick,
    so this names what the host and `UCX_TLS` leave UCX to choose from."""
    devices = sorted(p.name for p in devices_dir.glob("*")) if devices_dir.is_dir() else []
    tls = os.environ.get("UCX_TLS")
    narrowed = f", UCX_TLS={tls}" if tls else ""
    rdma_allowed = tls is None or any(t in tls.split(",") for t in ("all", "rc", "rc_x", "ud", "ud_x", "dc", "dc_x",
                                                                     "ib", "rc_v", "ud_v"))
    if devices and rdma_allowed:
        return f"RDMA verbs ({', '.join(devices)}{narrowed})", False
    reason = "no RDMA device" if not devices else "RDMA left out by UCX_TLS"
    return f"TCP or shared memory ({reason}{narrowed})", True


RESERVATION_TTL_S = 120.0  # a reserved slot nobody committed is free again after this (transfers give up at 30 s)


LANE_MIN_BYTES = 1 << 20  # a lane is woken per this much of a batch: less is not worth a thread handoff (40-75 us)
# writes: a lane per this much. Where the CPU copies, a second transfer at 4 MiB cost more than it shared (demotes
# at 0.70-0.80 of a raw transfer over 2 lanes, 0.80-0.85 over 1); at 16 MiB 2 lanes won (1.0-1.3 against 0.91-0.97)
WRITE_LANE_MIN_BYTES = 8 << 20
# a put sums its new blocks on the summing thread from this much (`_sums_ahead`). Measured against summing each
# just before its write, on 2 cores: 1 and 2 MiB 0.41-0.42 / 0.54-0.56 of a raw transfer against 0.45 / 0.57-0.58
# (the hand-off costs what it hides), 4 MiB 0.69-0.71 against 0.60-0.61, 8 MiB 0.77-0.78 against 0.62-0.64
SUMS_AHEAD_MIN_BYTES = 4 << 20
CHUNK_BYTES = 1 << 20  # a batch moves in transfers of about this size, each summed while in cache
PROGRESS_DELAY_US = 100  # default pause of an agent's progress thread between idle polls
MAX_DEFAULT_LANES = 2


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


def rdma_lanes() -> int:
    """NIXL agents ("lanes") a client spreads one large batch over (`KVCLUSTER_RDMA_LANES`, default 2, 1 per core at most).

    Why: every block read is verified, a second pass over bytes that just landed. Where the
    transfer itself is a CPU copy (UCX over shared memory or TCP: no RDMA NIC, as here) one
    thread doing both runs at 56-68% of the bare transfer. Each lane is an agent of its own
    (an agent is never used by two threads at once) that moves and verifies its share of
    the batch on its own core. 1 moves every batch over one agent in the calling thread.
    """
    raw = os.environ.get("KVCLUSTER_RDMA_LANES", "").strip()
    if not raw:
        return min(MAX_DEFAULT_LANES, default_workers())
    try:
        lanes = int(raw)
    except ValueError:
        lanes = 0
    if lanes < 1:
        raise StorageError(f"KVCLUSTER_RDMA_LANES must be a whole number of lanes >= 1, not {raw!r}")
    return lanes


_AGENT_CONFIG_LOCK = threading.Lock()
_OPEN: weakref.WeakSet = weakref.WeakSet()  # pools and clients whose agents are still alive


def _close_open_agents() -> None:
    """At exit, tear every agent down while the memory it registered still exists.

    Left to interpreter shutdown, a backend's tensors and its agents go in any order; an agent
    destroyed after its registered memory was freed crashed the process on exit (a
    segfault after all its work was done)."""
    for owner in list(_OPEN):
        owner.close()


atexit.register(_close_open_agents)


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
        _OPEN.add(self)
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
            view = host_bytes(data)
            slot = self.table.allocate(BlockKey(key)) if view.nbytes <= self.slot_bytes else None
            if slot is not None:
                self.table.commit(BlockKey(key), slot, view.nbytes, copy_hash(host[slot], view))
            ok.append(slot is not None)
        return ok

    def usage(self) -> int:
        """Bytes of slots holding committed blocks."""
        return len(self.table) * self.slot_bytes

    def close(self) -> None:
        """Destroy the agent now, before the slab it registered (idempotent); the pool lends nothing after."""
        agent, self.agent = self.agent, None
        del agent  # the last reference: NIXL deregisters the slab and stops its threads here
        _OPEN.discard(self)


class NixlRegionLender:
    """Memory someone else fills and frees (an engine's paged KV, host or device), registered with a NIXL agent of
    its own so other nodes read it in place; what lies where, and whether it is still valid, is kept elsewhere
    (`kvcluster.storage.lent.LentDirectory`, served by a control actor). Reads need nothing from this process
    but the registration: NIXL reads are one-sided."""

    def __init__(self, regions: Sequence[torch.Tensor], name: str | None = None) -> None:
        if not regions or len({(t.device.type, t.device.index) for t in regions}) > 1 \
                or not all(t.is_contiguous() for t in regions):
            raise StorageError("rdma: lent regions must be contiguous tensors, at least one, all on one device")
        self.agent = _agent(name or f"kvc-lend-{uuid.uuid4().hex[:8]}")
        self.regions = list(regions)  # kept alive while registered
        for region in self.regions:
            self.agent.register_memory(region)
        _OPEN.add(self)
        self.name = self.agent.name
        self.metadata = self.agent.get_agent_metadata()
        self.descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs(self.regions))

    def close(self) -> None:
        """Destroy the agent (idempotent): the memory stops being readable before its owner frees it."""
        agent, self.agent = self.agent, None
        del agent
        _OPEN.discard(self)


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


@dataclass(frozen=True)
class _Region:
    """Memory registered with this client's agents: NIXL's kind (DRAM or VRAM) and device of it."""

    start: int
    end: int
    mem: str
    device: int
    tensor: torch.Tensor  # kept alive while registered


@dataclass(frozen=True)
class _Local:
    """Buffers of one batch inside registered memory: their addresses, and the one kind they all are."""

    addrs: list[int]
    mem: str
    device: int


def _flat_bytes(data: Payload) -> np.ndarray | torch.Tensor:
    """Host bytes as numpy (CPU tensors too); a device tensor as its flat uint8 view."""
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        if not data.is_contiguous():
            raise ValueError(f"a tensor payload must be contiguous (shape {tuple(data.shape)})")
        return data.reshape(-1).view(torch.uint8)
    return host_bytes(data)


def _sum(view: np.ndarray | torch.Tensor) -> int:
    """A block's digest where it lies: on its device for device memory."""
    return tensor_hashes([view])[0] if isinstance(view, torch.Tensor) else checksum(view)


@dataclass(frozen=True)
class _Plane:
    """One registered region of a peer: slot s's piece of it starts at `base + s * stride`, `stride` bytes long."""

    base: int
    stride: int


def _planes(remote, slot_bytes: int) -> tuple[list[_Plane], tuple[str, int]]:
    """A peer's registered regions (NIXL descriptors) as planes of its slots, and their memory kind and device.

    A pool lends one region, slot after slot. An engine lends its paged KV: a region per layer, block b's page
    of each layer at `base + b * page`, a block being its pages in layer order. Either way a region of R bytes
    holds one piece of each of the peer's slots, so with N slots in all (total bytes / `slot_bytes`) its
    pieces are R / N bytes apart, and the pieces of one slot add up to `slot_bytes`."""
    count = remote.descCount() if hasattr(remote, "descCount") else 1
    regions = [(int(remote[i][0]), int(remote[i][1]), int(remote[i][2])) for i in range(count)]
    slots = sum(n for _, n, _ in regions) // slot_bytes if slot_bytes > 0 else 0
    if not regions or slots < 1 or any(n % slots for _, n, _ in regions) \
            or sum(n // slots for _, n, _ in regions) != slot_bytes or len({d for *_, d in regions}) > 1:
        raise StorageError(f"rdma: the peer's regions {[(hex(a), n) for a, n, _ in regions]} do not hold whole "
                           f"{slot_bytes}-byte slots on one device")
    kind = remote.getType() if hasattr(remote, "getType") else None
    mem = "VRAM" if "VRAM" in str(kind) else "DRAM"
    return [_Plane(base, n // slots) for base, n, _ in regions], (mem, regions[0][2])


def _paired(local: list[tuple[int, int]], peer: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(local, peer, length) pieces moving the bytes of `local` segments to or from `peer` segments in order:
    cut wherever either side's segment ends (the two cover the same number of bytes)."""
    pieces, i, j, di, dj = [], 0, 0, 0, 0
    while i < len(local) and j < len(peer):
        n = min(local[i][1] - di, peer[j][1] - dj)
        if n > 0:
            pieces.append((local[i][0] + di, peer[j][0] + dj, n))
        di, dj = di + n, dj + n
        if di == local[i][1]:
            i, di = i + 1, 0
        if dj == peer[j][1]:
            j, dj = j + 1, 0
    return pieces


class RDMABackend(StorageBackend):
    """A peer's pool as a tier of this node (client side)."""

    name = "rdma"

    def __init__(self, peer: PeerControl, staging_bytes: int, slots: int, name: str | None = None,
                 lanes: int | None = None) -> None:
        """`lanes`: agents a large batch is spread over (default `rdma_lanes()`); each exchanges metadata once."""
        self.peer = peer
        lanes = rdma_lanes() if lanes is None else lanes
        if lanes < 1:
            raise StorageError(f"rdma: lanes must be >= 1, not {lanes}")
        name = name or f"kvc-client-{uuid.uuid4().hex[:8]}"
        self._agents = [_agent(name if g == 0 else f"{name}-lane{g}") for g in range(lanes)]
        self.agent = self._agents[0]  # a batch too small to share goes over this one
        self.staging = torch.zeros(staging_bytes, dtype=torch.uint8)
        for agent in self._agents:
            agent.register_memory(self.staging)
        self._stage_np = self.staging.numpy()
        for agent in self._agents:
            meta, descs, self.slot_bytes, self.peer_name = peer.connect(agent.get_agent_metadata())
            agent.add_remote_agent(meta)
        if staging_bytes < self.slot_bytes:
            raise StorageError(f"rdma: a {staging_bytes}-byte staging buffer cannot hold one "
                               f"{self.slot_bytes}-byte block of {self.peer_name}")
        self._planes, self._peer_mem = _planes(self.agent.deserialize_descs(descs), self.slot_bytes)
        self._slots = slots
        self._regions: list[_Region] = []  # memory registered here (host or device)
        transport, self.emulated = ucx_transport()
        self.medium = f"peer DRAM pool via NIXL UCX over {transport}"
        self._stats = BackendStats()
        self._workers = BatchWorkers(lanes)  # lane g > 0 runs on a pool thread
        self._cores = default_workers()  # where the summing thread can run beside the caller
        _OPEN.add(self)

    def close(self) -> None:
        """Destroy the agents now, before the memory they registered (idempotent); later calls are misses."""
        agents, self._agents, self.agent = self._agents, [], None
        while agents:
            agent = agents.pop()
            try:
                agent.remove_remote_agent(self.peer_name)
            except Exception:  # noqa: BLE001 - a peer that is gone may already be forgotten
                pass
            del agent  # the last reference: NIXL deregisters our memory and stops its threads here
        _OPEN.discard(self)

    def register(self, region: torch.Tensor) -> None:
        """Register memory the caller lands blocks in or sends them from: host memory (its own tier pool) or
        device memory (a model's KV on a GPU, registered with NIXL as VRAM).

        Payloads and `out` buffers inside a registered region move straight between it and the peer's
        slab, without the staging copy; in device memory they are verified there (`tensor_hashes`).
        The caller keeps the region alive while this backend lives.
        """
        if region.device.type not in ("cpu", "cuda") or not region.is_contiguous():
            raise StorageError(f"rdma: only contiguous host or CUDA tensors can be registered, not a "
                               f"{'non-contiguous ' if not region.is_contiguous() else ''}{region.device} tensor")
        for agent in self._agents:
            agent.register_memory(region)
        start = region.data_ptr()
        device = (region.device.index or 0) if region.is_cuda else 0
        self._regions.append(_Region(start, start + region.numel() * region.element_size(),
                                     "VRAM" if region.is_cuda else "DRAM", device, region))

    def _count(self, what: str) -> None:
        self._stats.extra[what] = self._stats.extra.get(what, 0) + 1

    def _registered(self, arrays: Sequence, lengths: Sequence[int]) -> "_Local | None":
        """Each buffer's address when all of them lie (contiguous, long enough) inside registered memory of one
        kind (NIXL moves one kind of local memory per transfer)."""
        if not self._regions:
            return None
        addrs, kinds = [], set()
        for a, n in zip(arrays, lengths):
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous or a.nbytes < n:
                    return None
                addr = a.__array_interface__["data"][0]
            elif isinstance(a, torch.Tensor):
                if not a.is_contiguous() or a.nbytes < n:
                    return None
                addr = a.data_ptr()
            else:
                return None
            region = next((r for r in self._regions if r.start <= addr and addr + n <= r.end), None)
            if region is None:
                return None
            addrs.append(addr)
            kinds.add((region.mem, region.device))
        if len(kinds) > 1:
            return None
        mem, device = kinds.pop() if kinds else ("DRAM", 0)
        return _Local(addrs, mem, device)

    def _local_buffers(self, buffers: Sequence | None) -> list | None:
        """`out` buffers or payloads as this tier moves them: numpy for host memory, flat uint8 tensors for
        device memory, which must lie in a registered region (there is no staging buffer on a device)."""
        if buffers is None:
            return None
        flat = [_flat_bytes(b) for b in buffers]
        device = [b for b in flat if isinstance(b, torch.Tensor)]
        if device and self._registered(device, [b.nbytes for b in device]) is None:
            raise ValueError(f"{self.name}: device buffers must lie in memory registered with `register` "
                             f"(NIXL VRAM); got {device[0].device} tensors outside it")
        return flat

    def _peer_pieces(self, slot: int, length: int) -> list[tuple[int, int]]:
        """The first `length` bytes of peer slot `slot` as (peer address, length) pieces: one piece in a pool's
        slab, a page per plane in an engine's paged KV."""
        pieces = []
        for plane in self._planes:
            if length <= 0:
                break
            n = min(length, plane.stride)
            pieces.append((plane.base + slot * plane.stride, n))
            length -= n
        return pieces

    def _pieces(self, local: Sequence[tuple[int, int]], slot: int) -> list[tuple[int, int, int]]:
        """(local address, peer address, length) pieces moving local segments to or from peer slot `slot`."""
        return _paired(list(local), self._peer_pieces(slot, sum(n for _, n in local)))

    def _transfer(self, op: str, pieces: list[tuple[int, int, int]], lane: int = 0, mem: str = "DRAM",
                  device: int = 0) -> None:
        """One NIXL transfer over lane `lane`'s agent: (local address, peer address, length) pieces.

        Any NIXL failure (the peer process restarted or left: NIXL_ERR_REMOTE_DISCONNECT, a bad
        descriptor, a transfer in ERR, no answer in 30 s) is a StorageError: the caller's misses."""
        if not self._agents:
            raise StorageError("rdma: this backend was closed")
        agent = self._agents[lane]
        try:
            local_descs = agent.get_xfer_descs([(addr, n, device) for addr, _, n in pieces], mem)
            remote_descs = agent.get_xfer_descs([(remote, n, self._peer_mem[1]) for _, remote, n in pieces],
                                                self._peer_mem[0])
            handle = agent.initialize_xfer(op, local_descs, remote_descs, self.peer_name)
        except Exception as exc:  # noqa: BLE001 - NIXL's errors share no base class we could name
            raise StorageError(f"rdma: NIXL {op} could not start: {type(exc).__name__}: {exc}") from None
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + 30
            while state != "DONE":
                if state == "ERR" or time.monotonic() > deadline:
                    raise StorageError(f"rdma: NIXL {op} failed ({state})")
                state = agent.check_xfer_state(handle)
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise StorageError(f"rdma: NIXL {op} failed: {type(exc).__name__}: {exc}") from None
        finally:
            try:
                agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a handle of a vanished peer may not release cleanly
                pass

    def _lanes(self, lengths: Sequence[int], chunks: int, min_bytes: int = LANE_MIN_BYTES) -> int:
        """Lanes worth waking for a batch: each gets at least `min_bytes` of it (at least one lane)."""
        return max(1, min(len(self._agents), chunks, sum(lengths) // min_bytes))

    def _read_lanes(self, lengths: Sequence[int], pieces: Sequence[list[tuple[int, int, int]]],
                    verify: Callable[[int], bool], mem: str = "DRAM", device: int = 0) -> list[bool]:
        """Blocks k = 0.. read from the peer as `pieces[k]` (local address, peer address, length: one piece for a
        block landing whole, one per page for a block landing scattered); `verify(k)` per block.

        The batch moves in transfers of about CHUNK_BYTES; each lane (an agent on its own core)
        takes the next chunk when free and verifies it as it lands, while it is still in cache.
        A failed transfer raises StorageError once every started chunk is over (they write
        buffers the caller may reuse)."""
        chunks = _groups(lengths, CHUNK_BYTES)

        def move(g: int, c: int) -> list[bool]:
            part = chunks[c]
            self._transfer("READ", [p for k in part for p in pieces[k]], g, mem, device)
            return [verify(k) for k in part]

        moved = self._workers.drain(move, len(chunks), self._lanes(lengths, len(chunks)))
        return [good for chunk in moved for good in chunk]

    def _write_lanes(self, lengths: Sequence[int], local: Sequence[int], slots: Sequence[int],
                     digest: Callable[[int], int | None] | None, mem: str = "DRAM", device: int = 0
                     ) -> list[int | None]:
        """Blocks k = 0.. written from local addresses `local[k]` to the peer's `slots[k]`; their digests.

        Chunked and spread over the lanes like reads (a lane per WRITE_LANE_MIN_BYTES); `digest(k)`
        runs just before its chunk's write (a sum, or the staging copy that sums), which leaves the
        bytes in cache for it. With `digest` None the digests are known or summed elsewhere (None
        each here), and a batch moving over one lane goes as one transfer: chunks only serve lanes."""
        lanes = self._lanes(lengths, len(_groups(lengths, CHUNK_BYTES)), WRITE_LANE_MIN_BYTES)
        chunks = _groups(lengths, CHUNK_BYTES) if digest is not None or lanes > 1 else [range(len(lengths))]

        def move(g: int, c: int) -> list[int | None]:
            part = chunks[c]
            digests = [digest(k) if digest is not None else None for k in part]
            self._transfer("WRITE", [p for k in part for p in self._pieces([(local[k], lengths[k])], slots[k])], g,
                           mem, device)
            return digests

        moved = self._workers.drain(move, len(chunks), min(lanes, len(chunks)))
        return [d for chunk in moved for d in chunk]

    def _sums_ahead(self, views: Sequence, todo: Sequence[int]) -> dict[int, Callable[[], int]]:
        """Digests of host blocks `views[k]`, k in `todo`, summed on a native thread while the caller moves them.

        Why: a transfer and a sum only read the payload, so neither waits for the other; only
        the commit needs the digests. Over a NIC the transfer costs the CPU nothing and the sums
        hide behind it; where the CPU moves the bytes itself (UCX over shared memory or TCP) they
        run on another core. The thread never takes the GIL (`hash_in_background`): a Python
        pool thread cost the put a wake-up and GIL hand-offs of ~100 us before its transfer
        started, a quarter of a 4 MiB transfer (docs/tiers.md). Empty (summed inline, each just
        before its write) below SUMS_AHEAD_MIN_BYTES, for device memory (summed on its device) and
        on one core."""
        host = [k for k in todo if not isinstance(views[k], torch.Tensor)]
        if self._cores < 2 or sum(views[k].nbytes for k in host) < SUMS_AHEAD_MIN_BYTES:
            return {}
        job = hash_in_background([views[k] for k in host])
        return {k: (lambda j=j: job.wait()[j]) for j, k in enumerate(host)}

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

    def _staged(self, lengths: Sequence[int]) -> tuple[list[int], list[int]]:
        """Staging offsets of consecutive blocks (one part of `_batches`) and their registered addresses."""
        offsets = [0, *accumulate(lengths[:-1])] if lengths else []
        base = self.staging.data_ptr()
        return offsets, [base + off for off in offsets]

    def put_many(self, items: Sequence[tuple[BlockKey, Payload]],
                 digests: Sequence[int | None] | None = None) -> list[bool]:
        """One reserve, the NIXL writes, one commit per part of the batch; nothing uncommitted is ever read.

        Payloads inside registered memory go straight from there in one part, summed while the
        control call and the transfer run (`_sums_ahead`; a small batch just before each write)
        unless their digest is given (then the bytes are read once, by the transfer, as a NIC
        would); others are copied into the staging buffer (summed in the copy, and not committed
        if that differs from a given digest), as many parts as it takes. A reservation never
        committed is free again at the peer after RESERVATION_TTL_S."""
        given = given_digests(digests, len(items))
        views = [_flat_bytes(d) for _, d in items]
        keys = [bytes(k) for k, _ in items]
        lengths = [v.nbytes for v in views]
        direct = self._registered(views, lengths)
        if direct is None:  # staged: device payloads come to the host first
            views = [host_bytes(v) for v in views]
        ahead = {} if direct is None else self._sums_ahead(views, [i for i, d in enumerate(given) if d is None])
        ok = [False] * len(keys)
        try:
            for lo, hi in [(0, len(keys))] if direct is not None else self._batches(lengths):
                stored = self._put_part(keys, views, lengths, given, direct, ahead, lo, hi)
                if stored is None:  # the peer is gone or a write failed: the rest are not stored
                    break
                for i in stored:
                    ok[i] = True
        finally:  # sums still running read the caller's payloads: over before this returns
            for wait in ahead.values():
                wait()
        self._stats.puts += sum(ok)
        self._stats.put_failures += len(ok) - sum(ok)
        self._stats.put_bytes += sum(n for n, good in zip(lengths, ok) if good)
        return ok

    def _put_part(self, keys: list[bytes], views: list, lengths: list[int], given: list[int | None],
                  direct: "_Local | None", ahead: dict[int, Callable[[], int]], lo: int, hi: int) -> list[int] | None:
        """Blocks lo..hi-1 reserved, written and committed; the indices stored, None when the peer or a write failed."""
        try:
            slots = self.peer.reserve(keys[lo:hi], lengths[lo:hi])
        except PeerUnavailable:
            return None
        picked = [i for i, slot in zip(range(lo, hi), slots) if slot is not None]
        if not picked:
            return []
        sizes = [lengths[i] for i in picked]
        offsets, local = self._staged(sizes) if direct is None else ([], [direct.addrs[i] for i in picked])

        def digest(k: int) -> int | None:  # staged: the copy into the staging buffer sums on the way
            i = picked[k]
            if direct is None:
                return copy_hash(self._stage_np[offsets[k] : offsets[k] + sizes[k]], views[i])
            return given[i] if given[i] is not None or i in ahead else _sum(views[i])

        inline = direct is None or any(given[i] is None and i not in ahead for i in picked)
        mem, device = (direct.mem, direct.device) if direct is not None else ("DRAM", 0)
        try:
            moved = self._write_lanes(sizes, local, [slots[i - lo] for i in picked], digest if inline else None,
                                      mem, device)
        except StorageError:  # uncommitted slots are never read
            return None
        summed = [ahead[i]() if i in ahead else given[i] if d is None else d for i, d in zip(picked, moved)]
        intact = [k for k, i in enumerate(picked) if given[i] in (None, summed[k])]
        self._stats.digest_mismatches += len(picked) - len(intact)
        stored = [picked[k] for k in intact]
        try:
            self.peer.commit([keys[i] for i in stored], [slots[i - lo] for i in stored], [lengths[i] for i in stored],
                             [summed[k] for k in intact])
        except StorageError:
            return None
        if direct is not None:
            self._count("direct_writes")
        return stored

    def read_verified(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None
                      ) -> tuple[list[np.ndarray | None], list[int | None]]:
        results: list[np.ndarray | None] = [None] * len(keys)
        landed = self.read_into(keys, self._local_buffers(out), results)
        return [r if d is not None else None for r, d in zip(results, landed)], landed

    def read_into(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None,
                  results: list[np.ndarray | None], raise_unavailable: bool = False) -> list[int | None]:
        """Read blocks into `out` (or new arrays); `results[i]` gets the block, the return its verified checksum.

        When every `out` buffer lies in registered memory the peer's bytes land there directly (checksums
        verified in place); otherwise they pass through the staging buffer (verified in the copy out).
        None: missing at the peer, unreachable, or corrupt (then dropped at the peer too).
        `raise_unavailable`: an unreachable peer or a failed transfer raises (PeerUnavailable /
        StorageError) instead of reading as all misses, for callers that tell a fault from a miss.
        """
        digests: list[int | None] = [None] * len(keys)
        entries = self._lookup(keys, raise_unavailable)
        found = [i for i, e in enumerate(entries) if e is not None]
        if not found:
            return digests
        lengths = [entries[i][1] for i in found]
        direct = None if out is None else self._registered([out[i] for i in found], lengths)
        if out is not None and direct is None and any(isinstance(out[i], torch.Tensor) for i in found):
            raise ValueError(f"{self.name}: device buffers must all lie in registered memory of one kind")
        corrupt = []
        for lo, hi in [(0, len(found))] if direct is not None else self._batches(lengths):
            part, sizes = found[lo:hi], lengths[lo:hi]
            landing = [out[i][:n] if out is not None else aligned_empty(n) for i, n in zip(part, sizes)]
            offsets, local = self._staged(sizes) if direct is None else ([], direct.addrs[lo:hi])

            def verify(k: int) -> bool:  # staged: the copy out of the staging buffer sums on the way
                if direct is not None:
                    return _sum(landing[k]) == entries[part[k]][2]
                return copy_hash(landing[k], self._stage_np[offsets[k] : offsets[k] + sizes[k]]) == entries[part[k]][2]

            try:
                mem, device = (direct.mem, direct.device) if direct is not None else ("DRAM", 0)
                pieces = [self._pieces([(addr, n)], entries[i][0]) for addr, i, n in zip(local, part, sizes)]
                intact = self._read_lanes(sizes, pieces, verify, mem, device)
            except StorageError:  # peer gone between lookup and read: the rest are misses
                self._stats.misses += len(found) - lo
                if raise_unavailable:
                    raise
                break
            for i, data, good in zip(part, landing, intact):
                if good:
                    results[i], digests[i] = data, entries[i][2]
                else:
                    corrupt.append(i)  # what landed in `out[i]` is not handed out: a miss
            if direct is not None:
                self._count("direct_reads")
        self._read_done(keys, entries, found, digests, corrupt)
        return digests

    def read_segments(self, keys: Sequence[BlockKey], segments: Sequence[Sequence[torch.Tensor]],
                      raise_unavailable: bool = False) -> list[int | None]:
        """Read block i straight into `segments[i]`, flat uint8 tensors its bytes fill in order (an engine's pages
        of the block, one per layer), all inside memory registered with `register`, of one kind; verified
        where they landed (`hash_segments` on the host, `tensor_hashes` on a device). The return is each block's
        verified checksum, or None: missing at the peer, stored with another length than its segments (not
        this layout: a miss, left at the peer), or corrupt (dropped at the peer too). A block that is None may
        have left bytes in its segments: the caller treats them as garbage.

        Why: a block bound for a paged KV cache would otherwise land in a staging buffer, be copied into a
        row, then scattered into its pages: through host memory twice, and on a GPU across the bus from it.
        One transfer with one descriptor per page writes the pages themselves."""
        digests: list[int | None] = [None] * len(keys)
        if len(segments) != len(keys):
            raise ValueError(f"{self.name}: {len(segments)} segment lists for {len(keys)} blocks")
        if not keys:
            return digests
        flat = [[_flat_bytes(t) for t in segs] for segs in segments]
        every = [t for segs in flat for t in segs]
        direct = self._registered(every, [t.nbytes for t in every])
        if direct is None:
            raise ValueError(f"{self.name}: segments must all lie in memory registered with `register`, of one kind")
        starts = [0, *accumulate(len(segs) for segs in flat)]
        entries = self._lookup(keys, raise_unavailable)
        found = []
        for i, e in enumerate(entries):
            if e is not None and e[1] == sum(t.nbytes for t in flat[i]):
                found.append(i)
            elif e is not None:
                self._stats.misses += 1
                entries[i] = None
        if not found:
            return digests
        lengths = [entries[i][1] for i in found]
        pieces = [self._pieces([(addr, t.nbytes) for t, addr in zip(flat[i], direct.addrs[starts[i]:starts[i + 1]])],
                               entries[i][0]) for i in found]

        def verify(k: int) -> bool:
            segs = flat[found[k]]
            if isinstance(segs[0], torch.Tensor) and segs[0].device.type != "cpu":
                summed = tensor_hashes([torch.cat(segs)])[0]
            else:
                summed = hash_segments([t.numpy() if isinstance(t, torch.Tensor) else t for t in segs])
            return summed == entries[found[k]][2]

        try:
            intact = self._read_lanes(lengths, pieces, verify, direct.mem, direct.device)
        except StorageError:  # peer gone between lookup and read: all misses
            self._stats.misses += len(found)
            if raise_unavailable:
                raise
            return digests
        corrupt = [i for i, good in zip(found, intact) if not good]
        for i, good in zip(found, intact):
            if good:
                digests[i] = entries[i][2]
        self._count("segmented_reads")
        self._read_done(keys, entries, found, digests, corrupt)
        return digests

    def _lookup(self, keys: Sequence[BlockKey], raise_unavailable: bool) -> list:
        """The peer's (slot, length, digest) of each key, None where it has none; all None when it is gone."""
        try:
            entries = self.peer.lookup([bytes(k) for k in keys])
        except PeerUnavailable:  # the peer's memory is gone or unreachable: all misses
            self._stats.misses += len(keys)
            if raise_unavailable:
                raise
            return [None] * len(keys)
        self._stats.misses += sum(e is None for e in entries)
        return list(entries)

    def _read_done(self, keys: Sequence[BlockKey], entries: list, found: list[int], digests: list[int | None],
                   corrupt: list[int]) -> None:
        """Count a read's blocks, and drop the corrupt ones at the peer (a later read must not find them)."""
        good = [i for i in found if digests[i] is not None]
        self._stats.gets += len(good)
        self._stats.get_bytes += sum(entries[i][1] for i in good)
        if corrupt:
            for i in corrupt:
                self._dropped_corrupt(keys[i], "checksum mismatch after the transfer")
            try:
                self.peer.release([bytes(keys[i]) for i in corrupt])
            except PeerUnavailable:
                pass  # the peer's memory is gone anyway

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
                "lanes": len(self._agents), "capacity_bytes": self.capacity_bytes, **self._stats.__dict__}

    def check_integrity(self) -> None:
        assert self.staging.numel() > 0 and self._planes and all(p.base > 0 for p in self._planes)
