"""The NVMe tier: a preallocated slab file on a local path.

I/O path, best first, and reported in `medium`:
- KvikIO (GPUDirect Storage, or its compat mode) when a CUDA driver exists;
- POSIX with O_DIRECT (page-cache bypass, aligned buffers) where the filesystem allows;
- buffered POSIX `os.pwrite` / `os.preadv` otherwise (tmpfs, overlayfs).
Bytes pass through two aligned staging buffers: while one block is on its way to
or from the disk, another core copies the previous one (checksum summed in the
copy), so a batch costs about its I/O time, not I/O plus copies.
The slot index lives in memory: the tier is a cache, a restart starts it empty.
"""

from __future__ import annotations

import ctypes.util
import errno
import mmap
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..keys import BlockKey
from .base import BackendStats, Payload, SlottedBackend, StorageError
from .copyhash import copy_hash
from .parallel import BatchWorkers
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
        # two page-aligned staging buffers (O_DIRECT needs aligned memory): one on the disk, one being copied
        self._stages = [mmap.mmap(-1, self.slot_bytes) for _ in range(2)]
        self._stage_views = [np.frombuffer(stage, dtype=np.uint8) for stage in self._stages]
        self._workers = BatchWorkers()
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
        """Each payload is copied into a staging buffer (summed on the way) while the previous one is written."""
        ok = [False] * len(items)
        views = [np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8) for _, data in items]
        order = [i for i, view in enumerate(views) if view.nbytes <= self.slot_bytes]
        self._stats.put_failures += len(items) - len(order)
        background = self._workers.worth(sum(views[i].nbytes for i in order))
        fills: dict[int, Callable[[], int]] = {}

        def fill(j: int) -> None:  # stage j % 2 was last written out by item j - 2: free
            if j < len(order):
                fills[j] = self._workers.start(background, copy_hash, self._stage_views[j % 2], views[order[j]])

        fill(0)
        for j, i in enumerate(order):
            fill(j + 1)
            digest = fills.pop(j)()
            key = items[i][0]
            slot = self.table.allocate(key)
            if slot is None or self._write(self._stages[j % 2], slot * self.slot_bytes) != self.slot_bytes:
                if slot is not None:
                    self.table.abandon(slot)
                    self.table.release(key)
                self._stats.put_failures += 1
                continue
            self.table.commit(key, slot, views[i].nbytes, digest)
            self._stats.puts += 1
            self._stats.put_bytes += views[i].nbytes
            ok[i] = True
        return ok

    def get_many(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray | None]:
        """Each block is read into a staging buffer while the previous one is copied out and verified."""
        entries = [self.table.get(key) for key in keys]
        present = [i for i, entry in enumerate(entries) if entry is not None]
        self._stats.misses += len(keys) - len(present)
        results: list[np.ndarray | None] = [None] * len(keys)
        background = self._workers.worth(sum(entries[i].length for i in present))
        checks: dict[int, Callable[[], bool]] = {}

        def check(stage: int, i: int) -> bool:
            entry = entries[i]
            dst = out[i][: entry.length] if out is not None else np.empty(entry.length, dtype=np.uint8)
            results[i] = dst
            return copy_hash(dst, self._stage_views[stage][: entry.length]) == entry.checksum

        def settle(j: int) -> None:
            i = present[j]
            if checks.pop(j)():
                self._stats.gets += 1
                self._stats.get_bytes += entries[i].length
            else:  # what landed in `out[i]` is not handed out: a miss
                results[i] = None
                self._stats.corrupt += 1
                self.table.release(keys[i])

        for j, i in enumerate(present):
            if j - 2 in checks:
                settle(j - 2)  # its stage is needed again
            if self._read(self._stages[j % 2], entries[i].slot * self.slot_bytes) != self.slot_bytes:
                self._stats.corrupt += 1
                self.table.release(keys[i])
                continue
            checks[j] = self._workers.start(background, check, j % 2, i)
        for j in sorted(checks):
            settle(j)
        return results

    def _write(self, stage: mmap.mmap, offset: int) -> int:
        """Bytes written from a whole staging buffer, or -1 on an I/O error."""
        try:
            if self.kvikio is not None:
                return self.kvikio.pwrite(np.frombuffer(stage, dtype=np.uint8), self.slot_bytes, offset).get()
            return os.pwrite(self.fd, stage, offset)
        except (OSError, RuntimeError):  # RuntimeError: KvikIO's own I/O errors
            return -1

    def _read(self, stage: mmap.mmap, offset: int) -> int:
        """Bytes read into a whole staging buffer, or -1 on an I/O error."""
        try:
            if self.kvikio is not None:
                return self.kvikio.pread(np.frombuffer(stage, dtype=np.uint8), self.slot_bytes, offset).get()
            return os.preadv(self.fd, [stage], offset)
        except (OSError, RuntimeError):  # RuntimeError: KvikIO's own I/O errors
            return -1

    def stats(self) -> dict:
        return {**super().stats(), "o_direct": self.direct}

    def check_integrity(self) -> None:
        self.table.check_integrity()
        assert os.fstat(self.fd).st_size >= self.capacity_bytes

    def close(self) -> None:
        os.close(self.fd)
