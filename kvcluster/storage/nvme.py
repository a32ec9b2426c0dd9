"""The NVMe tier: a preallocated slab file on a local path.

I/O path, best first, and reported in `medium`:
- KvikIO (GPUDirect Storage, or its compat mode) when a CUDA driver exists;
- POSIX with O_DIRECT (page-cache bypass, aligned buffers) where the filesystem allows;
- buffered POSIX `os.pwrite` / `os.preadv` otherwise (tmpfs, overlayfs).
Page-aligned buffers (tier pools' rows, blocks this package's reads return: see
`aligned`) go to and from the disk in place, their checksums summed on another
core meanwhile. Other buffers pass through two aligned staging buffers: while
one block is on its way to or from the disk, another core copies the next one in
(or the previous one out), checksum summed in the copy, so a batch costs about
its I/O time, not I/O plus copies. A stage is written only once its copy is over.
The slot index lives in memory: the tier is a cache, a restart starts it empty. So a slab
has one owner (`slab_owner`): a second backend on the same file, in this process or
another, is refused with `SlabInUse` until the first is closed or its process exits.
"""

from __future__ import annotations

import ctypes.util
import errno
import mmap
import os
import weakref
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..keys import BlockKey
from .aligned import aligned_empty, is_aligned
from .base import BackendStats, Payload, SlottedBackend, StorageError, checksum, given_digests, host_bytes, host_out
from .copyhash import copy_hash
from .parallel import BatchWorkers
from .slab import SlotTable
from .slab_owner import hold, let_go

ALIGN = 4096
SHORT_READ = "short read or I/O error"
MISMATCH = "checksum mismatch"


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
        try:
            hold(self.fd, self.path)
        except StorageError:  # in use (SlabInUse), or not lockable
            os.close(self.fd)
            raise
        # released by close(), or when this backend is collected (a failed __init__ included): never twice
        self._release = weakref.finalize(self, let_go, self.fd, self.path)
        size = slots * self.slot_bytes
        try:
            os.posix_fallocate(self.fd, 0, size)
        except (OSError, OverflowError) as exc:
            self.path.unlink(missing_ok=True)  # while still held: no other opener gets this file
            self._release()
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

    def _in_place(self, view: np.ndarray) -> bool:
        """Whether the disk can take this buffer as it is (aligned for O_DIRECT, or no O_DIRECT at all)."""
        return self.kvikio is not None or not self.direct or is_aligned(view)

    def put_many(self, items: Sequence[tuple[BlockKey, Payload]],
                 digests: Sequence[int | None] | None = None) -> list[bool]:
        """Aligned payloads (a tier pool's rows) are written in place, their digests summed on another
        core meanwhile (and refused if that differs from a given digest); others are copied into a staging buffer
        (summed on the way, and refused if that differs from a given digest), the next one copied while
        this one is written. A key given twice in a batch stores its last payload."""
        ok = [False] * len(items)
        given = given_digests(digests, len(items))
        views = [host_bytes(data) for _, data in items]
        last = {key: i for i, (key, _) in enumerate(items)}
        fits = [i for i, view in enumerate(views) if view.nbytes <= self.slot_bytes and last[items[i][0]] == i]
        self._stats.put_failures += sum(view.nbytes > self.slot_bytes for view in views)
        fits = self._room_for(items, fits)
        direct = {i: self._in_place(views[i]) for i in fits}
        self._put_in_place(items, views, given, [i for i in fits if direct[i]], ok)
        self._put_staged(items, views, given, [i for i in fits if not direct[i]], ok)
        for i, (key, _) in enumerate(items):
            if last[key] != i and ok[last[key]]:
                ok[i] = True  # superseded by the same key later in this batch
        return ok

    def _room_for(self, items, order: list[int]) -> list[int]:
        """The items of `order` the free slots take, in batch order (a request's prefix first), whichever way
        each is then written; the rest are refused now. An item whose key is stored already reuses its slot."""
        free, admitted = self.table.free, []
        for i in order:
            if items[i][0] in self.table:
                admitted.append(i)
            elif free > 0:
                free -= 1
                admitted.append(i)
            else:
                self._stats.put_failures += 1
        return admitted

    def _store(self, key: BlockKey, buffer, nbytes: int, write_bytes: int, digest: Callable[[], int],
               expected: int | None = None) -> bool:
        """One block to a free slot: written, then committed with its digest; a failed write, or a digest
        other than the `expected` one the payload came with, leaves a miss.

        `buffer` must already hold the block's final bytes: the write starts at once. `digest` may
        still be running on another core (it only reads); it is waited for before the commit."""
        slot = self.table.allocate(key)
        written = slot is not None and self._write(buffer, write_bytes, slot * self.slot_bytes) == write_bytes
        summed = digest()  # a summing thread must be done with the buffer before the caller gets it back
        changed = written and expected is not None and summed != expected
        if not written or changed:
            if slot is not None:
                self.table.abandon(slot)
                self.table.release(key)
            self._stats.put_failures += 1
            self._stats.digest_mismatches += changed
            return False
        self.table.commit(key, slot, nbytes, summed)
        self._stats.puts += 1
        self._stats.put_bytes += nbytes
        return True

    def _put_in_place(self, items, views: list[np.ndarray], given: list[int | None], order: list[int],
                      ok: list[bool]) -> None:
        # summed on another core while this one writes; a given digest is checked against the sum before the
        # put is acknowledged, so a caller that drops its copy on our True never drops the only good one
        summed = self._workers.ahead(checksum, [views[i] for i in order], sum(views[i].nbytes for i in order))
        for i, digest in zip(order, summed):
            ok[i] = self._store(items[i][0], views[i], views[i].nbytes, views[i].nbytes, digest, given[i])

    def _put_staged(self, items, views: list[np.ndarray], given: list[int | None], order: list[int],
                    ok: list[bool]) -> None:
        background = self._workers.worth(sum(views[i].nbytes for i in order))
        fills: dict[int, Callable[[], int]] = {}

        def fill(j: int) -> None:  # stage j % 2 was last written out by item j - 2: free
            if j < len(order):
                fills[j] = self._workers.start(background, copy_hash, self._stage_views[j % 2], views[order[j]])

        fill(0)
        for j, i in enumerate(order):
            summed = fills.pop(j)()  # the stage holds this block only once its copy is over: then write it
            fill(j + 1)  # the next copy fills the other stage while this one is on its way to the disk
            ok[i] = self._store(items[i][0], self._stages[j % 2], views[i].nbytes, self.slot_bytes,
                                lambda d=summed: d, given[i])

    def read_verified(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None
                      ) -> tuple[list[np.ndarray | None], list[int | None]]:
        """Blocks land in place when their buffer is aligned (`out`'s, or a new aligned array), each verified
        on another core while the next is read; otherwise through a staging buffer, copied out and verified
        while the next one is read."""
        out = host_out(out, self.name)
        entries = [self.table.get(key) for key in keys]
        present = [i for i, entry in enumerate(entries) if entry is not None]
        self._stats.misses += len(keys) - len(present)
        short = [i for i in present if out is not None and out[i].nbytes < entries[i].length]
        if short:  # the caller's mistake, not the block's: raise before anything is read or dropped
            i = short[0]
            raise ValueError(f"nvme: out[{i}] holds {out[i].nbytes} bytes, its block has {entries[i].length}")
        results: list[np.ndarray | None] = [None] * len(keys)
        for i in present:
            results[i] = out[i][: entries[i].length] if out is not None else aligned_empty(entries[i].length)
        direct = {i: self._in_place(results[i]) for i in present}
        outcomes = (self._get_in_place(entries, results, [i for i in present if direct[i]])
                    + self._get_staged(entries, results, [i for i in present if not direct[i]]))
        for i, fault in outcomes:
            if fault is None:
                self._stats.gets += 1
                self._stats.get_bytes += entries[i].length
            else:  # unreadable, or what landed in `out[i]` does not match: not handed out, a miss
                results[i] = None
                self._dropped_corrupt(keys[i], fault)
                self.table.release(keys[i])
        return results, [e.checksum if r is not None else None for e, r in zip(entries, results)]

    def _get_in_place(self, entries, results, order: list[int]) -> list[tuple[int, str | None]]:
        """(i, None) for each block read intact, (i, why) for each that was not."""
        background = self._workers.worth(sum(entries[i].length for i in order))
        checks = []
        for i in order:
            entry = entries[i]
            if self._read(results[i], entry.length, entry.slot * self.slot_bytes) != entry.length:
                checks.append((i, lambda: SHORT_READ))
                continue
            checks.append((i, self._workers.start(background, lambda data=results[i], digest=entry.checksum:
                                                   None if checksum(data) == digest else MISMATCH)))
        return [(i, check()) for i, check in checks]

    def _get_staged(self, entries, results, order: list[int]) -> list[tuple[int, str | None]]:
        background = self._workers.worth(sum(entries[i].length for i in order))
        checks: dict[int, Callable[[], str | None]] = {}
        outcomes = []

        def check(stage: int, i: int) -> str | None:
            landed = copy_hash(results[i], self._stage_views[stage][: entries[i].length])
            return None if landed == entries[i].checksum else MISMATCH

        for j, i in enumerate(order):
            if j - 2 in checks:
                outcomes.append((order[j - 2], checks.pop(j - 2)()))  # its stage is needed again
            if self._read(self._stages[j % 2], self.slot_bytes, entries[i].slot * self.slot_bytes) != self.slot_bytes:
                outcomes.append((i, SHORT_READ))
                continue
            checks[j] = self._workers.start(background, check, j % 2, i)
        outcomes += [(order[j], checks[j]()) for j in sorted(checks)]
        return outcomes

    def _write(self, buffer, nbytes: int, offset: int) -> int:
        """Bytes written from the first `nbytes` of `buffer`, or -1 on an I/O error."""
        try:
            if self.kvikio is not None:
                return self.kvikio.pwrite(np.frombuffer(buffer, dtype=np.uint8), nbytes, offset).get()
            return os.pwrite(self.fd, memoryview(buffer)[:nbytes], offset)
        except (OSError, RuntimeError):  # RuntimeError: KvikIO's own I/O errors
            return -1

    def _read(self, buffer, nbytes: int, offset: int) -> int:
        """Bytes read into the first `nbytes` of `buffer`, or -1 on an I/O error."""
        try:
            if self.kvikio is not None:
                return self.kvikio.pread(np.frombuffer(buffer, dtype=np.uint8), nbytes, offset).get()
            return os.preadv(self.fd, [memoryview(buffer)[:nbytes]], offset)
        except (OSError, RuntimeError):  # RuntimeError: KvikIO's own I/O errors
            return -1

    def stats(self) -> dict:
        return {**super().stats(), "o_direct": self.direct}

    def check_integrity(self) -> None:
        self.table.check_integrity()
        assert os.fstat(self.fd).st_size >= self.capacity_bytes

    def close(self) -> None:
        """Close the slab and give up owning it (idempotent): another backend may open it now. The descriptor's
        number is forgotten too: a stray call after this fails instead of reaching a file opened later."""
        self._release()
        self.fd = -1
