"""In-memory tiers: HBM (device tensors), DRAM (host pool) and CXL (NUMA-bound pool).

All three are one preallocated slab of `slots x slot_bytes` bytes. HBM lives on
the CUDA device when there is one and on the CPU otherwise (reported); DRAM is
pinned when CUDA exists; CXL binds its pages to a CPU-less NUMA node (the way
Linux exposes a CXL Type-3 expander) and otherwise is a DRAM pool reporting
`emulated: true`. Reads from DRAM and CXL verify the checksum, computed during the
copy itself (`copyhash`); HBM, the tier the model reads directly, does not. A host
pool spreads a large batch's copies over the cores (`parallel.BatchWorkers`).

Payloads and `out` buffers may be torch tensors on any device, so blocks move
between a model's device memory and a pool without a bounce through pageable host
memory: device to device within HBM, one DMA between a device tensor and a pinned
host slot. A host pool sums such blocks on the device (`tensor_hashes`): a block it
hands to a device is verified where it landed, a block it takes from one is summed
there before the DMA. Copies touching a device finish before a call returns, so
callers may reuse or read their buffers at once.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from ..keys import BlockKey
from .aligned import aligned_empty, aligned_host_tensor
from .base import BackendStats, Payload, SlottedBackend, StorageError, given_digests
from .copyhash import copy_hash, tensor_hashes
from .numa import bind_to_node, cpuless_numa_nodes
from .parallel import BatchWorkers
from .slab import SlotTable


class MemoryPoolBackend(SlottedBackend):
    device_buffers = True  # DMA into or out of device tensors, verified there
    def __init__(self, name: str, slots: int, slot_bytes: int, *, device: str = "cpu", pin: bool = False,
                 verify: bool = True, medium: str = "", emulated: bool = False,
                 workers: int | None = None) -> None:
        if slot_bytes <= 0:
            raise StorageError(f"{name}: slot_bytes must be positive")
        self.name, self.medium, self.emulated = name, medium or f"{device} memory", emulated
        self.slot_bytes, self.verify, self.device = slot_bytes, verify, device
        try:
            if device == "cpu":  # page-aligned rows: the NVMe tier writes a demoted block straight from its slot
                self.pool = aligned_host_tensor(slots, slot_bytes, pin=pin)
            else:
                self.pool = torch.empty((slots, slot_bytes), dtype=torch.uint8, device=device, pin_memory=pin)
        except (RuntimeError, ValueError) as exc:
            raise StorageError(f"{name}: cannot allocate {slots} x {slot_bytes} bytes on {device}: {exc}") from None
        self._host = self.pool.numpy() if device == "cpu" else None
        self.table = SlotTable(slots)
        self._stats = BackendStats()
        self._workers = BatchWorkers(workers)

    def put_many(self, items: Sequence[tuple[BlockKey, Payload]],
                 digests: Sequence[int | None] | None = None) -> list[bool]:
        """One copy per block, summed on the way (unless the pool does not verify, as HBM); a block whose
        sum differs from its given digest changed since it was verified and is refused."""
        views = [_bytes_view(data) for _, data in items]  # host bytes as numpy, device bytes as tensors
        given = given_digests(digests, len(items))
        if not self.verify:  # nothing summed here to compare with, nothing stored for reads to check
            given = [None] * len(items)
        last = {key: i for i, (key, _) in enumerate(items)}  # a key given twice: its last payload is stored
        slots: list[int | None] = [None] * len(items)
        for i, (key, _) in enumerate(items):
            if last[key] == i and views[i].nbytes <= self.slot_bytes:
                slots[i] = self.table.allocate(key)
        summed = [0] * len(items)
        on_device = [i for i, v in enumerate(views) if type(v) is not np.ndarray]  # (a type test: cheap per block)
        if on_device and self._host is not None and self.verify:  # into host slots: summed on their device
            hashed = [i for i in on_device if slots[i] is not None]
            for i, digest in zip(hashed, tensor_hashes([views[i] for i in hashed])):
                summed[i] = digest

        def store(i: int) -> None:
            slot, view = slots[i], views[i]
            if slot is None:
                return
            if self._host is None or type(view) is not np.ndarray:  # a copy touching a device: DMA
                self.pool[slot, : view.nbytes].copy_(_as_tensor(view), non_blocking=True)
            elif self.verify:
                summed[i] = copy_hash(self._host[slot], view)
            else:
                self._host[slot, : view.nbytes] = view

        try:
            self._run(store, len(items), sum(v.nbytes for v in views))
            if on_device or self._host is None:
                self._finish_device_copies([views[i] for i in on_device])
        except BaseException:  # nothing of this batch was committed: new keys' slots go back to the free list
            for i, (key, _) in enumerate(items):
                if slots[i] is not None and key not in self.table:
                    self.table.abandon(slots[i])
            raise
        changed = [i for i in range(len(items)) if slots[i] is not None and given[i] not in (None, summed[i])]
        for i in changed:  # not what was verified below: refused, as a failed write is
            if items[i][0] not in self.table:
                self.table.abandon(slots[i])
            self.table.release(items[i][0])
            slots[i] = None
        self._stats.digest_mismatches += len(changed)
        ok = []
        for i, (key, _) in enumerate(items):
            if slots[i] is not None:
                self.table.commit(key, slots[i], views[i].nbytes, summed[i])
                self._stats.puts += 1
                self._stats.put_bytes += views[i].nbytes
                ok.append(True)
            elif last[key] != i and slots[last[key]] is not None:
                ok.append(True)  # superseded by the same key later in this batch
            else:
                self._stats.put_failures += 1
                ok.append(False)
        return ok

    def read_verified(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None
                      ) -> tuple[list[np.ndarray | None], list[int | None]]:
        entries = [self.table.get(key) for key in keys]
        results: list[np.ndarray | None] = [None] * len(keys)
        intact = [False] * len(keys)

        def load(i: int) -> None:
            entry = entries[i]
            if entry is None:
                return
            dst = _bytes_view(out[i])[: entry.length] if out is not None else aligned_empty(entry.length)
            results[i] = dst
            if self._host is None or type(dst) is not np.ndarray:  # a copy touching a device: DMA
                _as_tensor(dst).copy_(self.pool[entry.slot, : entry.length], non_blocking=True)
                # a host slot's block is summed where it landed, below; a device pool does not verify
                intact[i] = self._host is None or not self.verify
            elif self.verify:
                intact[i] = copy_hash(dst, self._host[entry.slot, : entry.length]) == entry.checksum
            else:
                np.copyto(dst, self._host[entry.slot, : entry.length])
                intact[i] = True

        self._run(load, len(keys), sum(e.length for e in entries if e is not None))
        landed = [i for i, r in enumerate(results) if r is not None and type(r) is not np.ndarray]
        if landed or self._host is None:
            self._finish_device_copies([results[i] for i in landed])
        if landed and self._host is not None and self.verify:  # blocks DMAed to a device: verified there, at once
            for i, digest in zip(landed, tensor_hashes([results[i] for i in landed])):
                intact[i] = digest == entries[i].checksum
        for i, (key, entry) in enumerate(zip(keys, entries)):
            if entry is None:
                self._stats.misses += 1
            elif not intact[i]:
                self._dropped_corrupt(key, "checksum mismatch")
                self.table.release(key)
                results[i] = None
            else:
                self._stats.gets += 1
                self._stats.get_bytes += entry.length
        verified = [e.checksum if self.verify and r is not None else None for e, r in zip(entries, results)]
        return results, verified

    def _finish_device_copies(self, buffers: Sequence) -> None:
        """Wait for this call's DMAs (queued on the current stream of each device involved)."""
        devices = {b.device for b in buffers if b.device.type != "cpu"}
        if self.pool.device.type != "cpu":
            devices.add(self.pool.device)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()

    def _run(self, fn, n: int, nbytes: int) -> None:
        """Host pools spread a batch's copies and hashes over the cores; device pools copy in order."""
        if self._host is not None:
            self._workers.run(fn, n, nbytes)
        else:
            for i in range(n):
                fn(i)

    def check_integrity(self) -> None:
        self.table.check_integrity()


def _bytes_view(data: Payload) -> np.ndarray | torch.Tensor:
    """A payload's bytes, flat: a numpy view of host memory (CPU tensors too), a uint8 tensor of device memory."""
    if type(data) is np.ndarray and data.dtype == np.uint8 and data.ndim == 1:  # the common case, tested first
        return data
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise ValueError(f"a tensor payload must be contiguous (shape {tuple(data.shape)}, "
                             f"strides {data.stride()})")
        flat = data.reshape(-1).view(torch.uint8)
        return flat.numpy() if flat.device.type == "cpu" else flat
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        return data.view(np.ndarray)  # a subclass (a memmap) as a plain array: host bytes are ndarrays here
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


def _as_tensor(view: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A tensor over the same bytes (no copy); a read-only numpy view is only ever read from here."""
    if isinstance(view, torch.Tensor):
        return view
    if not view.flags.writeable:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(view)
    return torch.from_numpy(view)



def hbm_backend(slots: int, slot_bytes: int) -> MemoryPoolBackend:
    """Device memory of the replica; CPU tensors stand in where there is no CUDA device."""
    cuda = torch.cuda.is_available()
    return MemoryPoolBackend("hbm", slots, slot_bytes, device="cuda" if cuda else "cpu", verify=False,
                             medium="CUDA device memory" if cuda else "CPU tensors (no CUDA device)", emulated=not cuda)


def dram_backend(slots: int, slot_bytes: int) -> MemoryPoolBackend:
    pin = torch.cuda.is_available()
    return MemoryPoolBackend("dram", slots, slot_bytes, pin=pin, medium="pinned host memory" if pin else "host memory")


def cxl_backend(slots: int, slot_bytes: int) -> MemoryPoolBackend:
    """A pool whose pages live on a CPU-less NUMA node when the machine has one."""
    nodes = cpuless_numa_nodes()
    backend = MemoryPoolBackend("cxl", slots, slot_bytes, medium="host memory (no CPU-less NUMA node: emulated CXL)",
                                emulated=True)
    if nodes:
        try:
            bind_to_node(backend.pool.data_ptr(), backend.capacity_bytes, nodes[0])
            backend.pool.zero_()  # fault the pages in on that node
            backend.medium, backend.emulated = f"CXL memory, NUMA node {nodes[0]}", False
        except OSError as exc:
            backend.medium = f"host memory (mbind to node {nodes[0]} failed: {exc}; emulated CXL)"
    return backend
