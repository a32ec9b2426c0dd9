"""In-memory tiers: HBM (device tensors), DRAM (host pool) and CXL (NUMA-bound pool).

All three are one preallocated slab of `slots x slot_bytes` bytes. HBM lives on
the CUDA device when there is one and on the CPU otherwise (reported); DRAM is
pinned when CUDA exists; CXL binds its pages to a CPU-less NUMA node (the way
Linux exposes a CXL Type-3 expander) and otherwise is a DRAM pool reporting
`emulated: true`. Reads from DRAM and CXL verify the checksum; HBM, the tier the
model reads directly, does not.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..keys import BlockKey
from .base import BackendStats, Payload, SlottedBackend, StorageError, checksum
from .numa import bind_to_node, cpuless_numa_nodes
from .slab import SlotTable


class MemoryPoolBackend(SlottedBackend):
    def __init__(self, name: str, slots: int, slot_bytes: int, *, device: str = "cpu", pin: bool = False,
                 verify: bool = True, medium: str = "", emulated: bool = False) -> None:
        if slot_bytes <= 0:
            raise StorageError(f"{name}: slot_bytes must be positive")
        self.name, self.medium, self.emulated = name, medium or f"{device} memory", emulated
        self.slot_bytes, self.verify, self.device = slot_bytes, verify, device
        try:
            self.pool = torch.empty((slots, slot_bytes), dtype=torch.uint8, device=device, pin_memory=pin)
        except (RuntimeError, ValueError) as exc:
            raise StorageError(f"{name}: cannot allocate {slots} x {slot_bytes} bytes on {device}: {exc}") from None
        self._host = self.pool.numpy() if device == "cpu" else None
        self.table = SlotTable(slots)
        self._stats = BackendStats()

    def put_many(self, items: Sequence[tuple[BlockKey, Payload]]) -> list[bool]:
        ok = []
        host, table, verify = self._host, self.table, self.verify
        for key, data in items:
            view = data if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1 \
                else np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
            slot = self.table.allocate(key) if view.nbytes <= self.slot_bytes else None
            if slot is None:
                self._stats.put_failures += 1
                ok.append(False)
                continue
            if self._host is not None:
                self._host[slot, : view.nbytes] = view
            else:
                self.pool[slot, : view.nbytes].copy_(torch.from_numpy(view.copy()), non_blocking=False)
            self.table.commit(key, slot, view.nbytes, checksum(view) if self.verify else 0)
            self._stats.puts += 1
            self._stats.put_bytes += view.nbytes
            ok.append(True)
        return ok

    def get_many(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray | None]:
        results: list[np.ndarray | None] = []
        for i, key in enumerate(keys):
            entry = self.table.get(key)
            if entry is None:
                self._stats.misses += 1
                results.append(None)
                continue
            src = self._host[entry.slot, : entry.length] if self._host is not None else \
                self.pool[entry.slot, : entry.length].cpu().numpy()
            dst = out[i][: entry.length] if out is not None else np.empty(entry.length, dtype=np.uint8)
            np.copyto(dst, src)
            if self.verify and checksum(dst) != entry.checksum:
                self._stats.corrupt += 1
                self.table.release(key)
                results.append(None)
                continue
            self._stats.gets += 1
            self._stats.get_bytes += entry.length
            results.append(dst)
        return results

    def check_integrity(self) -> None:
        self.table.check_integrity()


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
