"""The NVMe tier: a preallocated slab file on a local path.

I/O path, best first, and reported in `medium`:
- KvikIO (GPUDirect Storage, or its compat mode) when a CUDA driver exists;
- POSIX with O_DIRECT (page-cache bypass, aligned buffers) where the filesystem allows;
- buffered POSIX `os.pwrite` / `os.preadv` otherwise (tmpfs, overlayfs).
The slot index lives in memory: the tier is a cache, a restart starts it empty.
"""

from __future__ import annotations

import ctypes.util
import errno
import mmap
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..keys import BlockKey
from .base import BackendStats, Payload, SlottedBackend, StorageError, checksum
from .slab import SlotTable

ALIGN = 4096


def _cuda_driver_present() -> bool:
    return ctypes.util.find_library("cuda") is not None


class NVMeBackend(SlottedBackend):
    name = "nvme"

    def __init__(self, directory: str | Path, slots: int, slot_bytes: int, *, direct: bool = True) -> None:
        self.dir = Path(directory)
        self.slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
        self.path = self.dir / "kvcluster-nvme.slab"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.fd, self.direct = self._open(direct)
        except OSError as exc:
            raise StorageError(f"nvme: cannot open a slab file in {self.dir}: {exc.strerror or exc}") from None
        size = slots * self.slot_bytes
        try:
            os.posix_fallocate(self.fd, 0, size)
        except (OSError, OverflowError) as exc:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
            reason = "not enough free space" if getattr(exc, "errno", errno.ENOSPC) in (errno.ENOSPC, errno.EFBIG) \
                else exc.strerror
            raise StorageError(f"nvme: cannot reserve {size:,} bytes in {self.dir}: {reason}") from None
        self.kvikio = self._kvikio_file()
        path = "kvikio" if self.kvikio else "posix-odirect" if self.direct else "posix-buffered"
        self.medium = f"slab file {self.path} via {path}"
        self.emulated = self.kvikio is None  # no GPUDirect Storage: bytes go through host memory
        self._stage = mmap.mmap(-1, self.slot_bytes)  # page-aligned, as O_DIRECT requires
        self._stage_view = np.frombuffer(self._stage, dtype=np.uint8)
        self.table = SlotTable(slots)
        self._stats = BackendStats()

    def _open(self, direct: bool) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CREAT
        if direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(self.path, flags | os.O_DIRECT, 0o600), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                    raise
        return os.open(self.path, flags, 0o600), False

    def _kvikio_file(self):
        if not _cuda_driver_present():
            return None
        try:
            import kvikio  # optional extra [gds]

            return kvikio.CuFile(str(self.path), "r+")
        except Exception:  # noqa: BLE001 - any kvikio failure means: use POSIX
            return None

    def put_many(self, items: Sequence[tuple[BlockKey, Payload]]) -> list[bool]:
        ok = []
        for key, data in items:
            view = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
            slot = self.table.allocate(key) if view.nbytes <= self.slot_bytes else None
            if slot is None:
                self._stats.put_failures += 1
                ok.append(False)
                continue
            self._stage_view[: view.nbytes] = view
            try:
                written = os.pwrite(self.fd, self._stage, slot * self.slot_bytes)
            except OSError:
                written = -1
            if written != self.slot_bytes:
                self.table.abandon(slot)
                self.table.release(key)
                self._stats.put_failures += 1
                ok.append(False)
                continue
            self.table.commit(key, slot, view.nbytes, checksum(view))
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
            try:
                n = os.preadv(self.fd, [self._stage], entry.slot * self.slot_bytes)
            except OSError:
                n = -1
            data = self._stage_view[: entry.length]
            if n != self.slot_bytes or checksum(data) != entry.checksum:
                self._stats.corrupt += 1
                self.table.release(key)
                results.append(None)
                continue
            dst = out[i][: entry.length] if out is not None else np.empty(entry.length, dtype=np.uint8)
            np.copyto(dst, data)
            self._stats.gets += 1
            self._stats.get_bytes += entry.length
            results.append(dst)
        return results

    def stats(self) -> dict:
        return {**super().stats(), "o_direct": self.direct}

    def check_integrity(self) -> None:
        self.table.check_integrity()
        assert os.fstat(self.fd).st_size >= self.capacity_bytes

    def close(self) -> None:
        os.close(self.fd)
