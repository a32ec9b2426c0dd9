"""The shared-filesystem tier: content-addressed block files under one root.

Layout: `ROOT/kv/ab/cd/<32 hex key>.kvb`, the path derived only from the key
(never from user text) and checked to stay under ROOT. Each file is the payload
at offset 0 and a trailer after it (magic, version, payload length, checksum),
written to a unique temp name in the same directory and renamed into place:
concurrent writers of the same key on several nodes leave exactly one complete
file, and a reader never sees a partial one. A key already on file is not
written again (equal keys mean equal KV), so a popular prefix written back by
many replicas costs one file. A file that fails its checks is a miss and is
removed, and the next put writes it afresh.

Why a trailer, not a header: the payload then starts on a page boundary of the
file, and the kernel copies page-aligned bytes into the page cache faster (a
2 MiB write at offset 24 took 1.18x as long as at 0 or 4,096 on this path). Why
the digest goes last: a put sums each 256 KiB of the payload right before
writing it (`copyhash.pwrite_hash`), so the digest is known only once the
payload is written. A get sums each 256 KiB as it lands (`copyhash.pread_hash`).
"""

from __future__ import annotations

import errno
import os
import struct
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np

from ..keys import KEY_BYTES, BlockKey
from .aligned import aligned_empty
from .base import BackendStats, Payload, StorageBackend, StorageError, given_digests, host_bytes, host_out
from .copyhash import pread_hash, pwrite_hash
from .parallel import PARALLEL_MIN_BYTES, BatchWorkers

MAGIC = b"KVCB"
TRAILER = struct.Struct("<4sHxxQQ")  # magic, version, length, checksum; after the payload
# 1-3 held these fields in a header before the payload (1 an xxh3-64, 2 an xxh3-finalized fletcher64x4):
# such files fail the trailer's checks and are misses
VERSION = 4


class PFSBackend(StorageBackend):
    name = "pfs"

    def __init__(self, root: str | Path, capacity_bytes: int) -> None:
        self.root = Path(root).resolve()
        self.base = self.root / "kv"
        try:
            self.base.mkdir(parents=True, exist_ok=True)
            probe = self.base / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StorageError(f"pfs: cannot write under {self.root}: {exc.strerror or exc}") from None
        self.medium = f"files under {self.root}"
        self.emulated = False
        self._capacity = capacity_bytes
        self._base = str(self.base)
        self._dirs: set[str] = set()
        self._stats = BackendStats()
        self._workers = BatchWorkers()

    def path_for(self, key: BlockKey) -> Path:
        return Path(self._file(key))

    def _file(self, key: BlockKey) -> str:
        """The block's file name; plain string joins, as pathlib costs ~20 us a block on this path."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"block keys are {KEY_BYTES}-byte digests, got {len(key)} bytes")
        hexkey = bytes(key).hex()  # [0-9a-f] only: no separator, no "..", cannot leave base
        return f"{self._base}/{hexkey[:2]}/{hexkey[2:4]}/{hexkey}.kvb"

    def put_many(self, items: Sequence[tuple[BlockKey, Payload]],
                 digests: Sequence[int | None] | None = None) -> list[bool]:
        """Each new block summed, written to a temp file and renamed into place; a payload whose sum differs
        from its given digest changed since it was verified and is refused (never acknowledged).

        Each payload is summed 256 KiB at a time right before that chunk's write (`pwrite_hash`), so the
        write copies bytes the sum just brought into cache: one pass over memory, no thread hand-off (which
        cost a 4 MiB put about a sixth of its time). A batch of >= PARALLEL_MIN_BYTES spreads its files over the
        cores (`BatchWorkers.drain`). A temp file is renamed into place only whole, so no reader sees the
        order it was written in."""
        ok = [False] * len(items)
        given = given_digests(digests, len(items))
        todo: list[tuple[int, str, memoryview]] = []
        room = self._capacity - self.used_bytes
        batch: set[str] = set()
        for i, (key, data) in enumerate(items):
            view, file = memoryview(host_bytes(data)), self._file(key)
            if file in batch or os.path.exists(file):  # content-addressed: equal keys hold equal bytes, so one copy serves
                self._stats.extra["already_stored"] = self._stats.extra.get("already_stored", 0) + 1
                ok[i] = True
            elif view.nbytes > room:
                self._stats.put_failures += 1
            else:
                todo.append((i, file, view))
                batch.add(file)
                room -= view.nbytes
        nbytes = sum(view.nbytes for _, _, view in todo)
        lanes = self._workers.workers if nbytes >= PARALLEL_MIN_BYTES else 1
        outcomes = self._workers.drain(lambda _lane, k: self._store(todo[k][1], todo[k][2], given[todo[k][0]]),
                                       len(todo), lanes)
        for (i, _, view), outcome in zip(todo, outcomes):
            if outcome == "stored":
                self._stats.puts += 1
                self._stats.put_bytes += view.nbytes
                if self._used is not None:
                    self._used += view.nbytes
                ok[i] = True
            else:
                self._stats.put_failures += 1
                if outcome == "mismatch":
                    self._stats.digest_mismatches += 1
        return ok

    def read_verified(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None
                      ) -> tuple[list[np.ndarray | None], list[int | None]]:
        out = host_out(out, self.name)
        results: list[np.ndarray | None] = []
        verified: list[int | None] = []
        for i, key in enumerate(keys):
            file = self._file(key)
            try:
                dst, digest, fault = self._read(file, None if out is None else out[i], f"out[{i}]")
            except FileNotFoundError:
                self._stats.misses += 1
                results.append(None)
                verified.append(None)
                continue
            verified.append(digest if dst is not None else None)
            if dst is None:
                self._dropped_corrupt(key, fault)
                try:
                    os.unlink(file)
                except OSError:  # gone already, or a read-only mount: the bad file stays a miss on every read
                    pass
                results.append(None)
                continue
            self._stats.gets += 1
            self._stats.get_bytes += dst.nbytes
            results.append(dst)
        return results, verified

    def _store(self, file: str, view: memoryview, given: int | None) -> str:
        """One block's file, written whole under a temp name and renamed into place: "stored", "mismatch" (its
        sum is not `given`: the payload changed since it was verified) or "failed" (no space, a read-only or
        vanished mount: the block stays a miss). Runs on any lane of the batch: it touches no shared state."""
        tmp = f"{os.path.dirname(file)}/.{os.path.basename(file)}.{os.urandom(8).hex()}.tmp"
        try:
            digest = self._write(tmp, view)
            if given is not None and digest != given:  # the caller may drop its own copy on our True
                os.unlink(tmp)
                return "mismatch"
            os.replace(tmp, file)
            return "stored"
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return "failed"

    def _write(self, tmp: str, view: memoryview) -> int:
        """A new temp file: the payload at offset 0, summed chunk by chunk as it is written (`pwrite_hash`),
        then the trailer with that digest; returns the digest."""
        directory = os.path.dirname(tmp)
        if directory not in self._dirs:
            os.makedirs(directory, exist_ok=True)
            self._dirs.add(directory)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _, digest = pwrite_hash(fd, view, 0)
            _write_all(fd, memoryview(TRAILER.pack(MAGIC, VERSION, view.nbytes, digest)), view.nbytes)
            return digest
        finally:
            os.close(fd)

    @staticmethod
    def _read(file: str, out: np.ndarray | None, name: str = "out") -> tuple[np.ndarray | None, int, str]:
        """Trailer, then the payload straight into `out`, summed as it lands; (payload or None when the file
        fails a check, its trailer's digest, what failed). An `out` too small for the block is the caller's
        mistake, not the file's: a ValueError, and the file stays (it was dropped as corrupt before)."""
        try:
            fd = os.open(file, os.O_RDONLY)
        except FileNotFoundError:
            raise
        except OSError as exc:
            return None, 0, f"cannot open: {exc.strerror}"
        try:
            length = os.fstat(fd).st_size - TRAILER.size
            if length < 0:
                return None, 0, "shorter than its trailer"
            if out is not None and out.nbytes < length:
                raise ValueError(f"pfs: {name} holds {out.nbytes} bytes, its block has {length}")
            trailer = os.pread(fd, TRAILER.size, length)
            if len(trailer) != TRAILER.size:
                return None, 0, "short trailer read"
            magic, version, stored_length, digest = TRAILER.unpack(trailer)
            if (magic, version, stored_length) != (MAGIC, VERSION, length):
                return None, 0, "bad trailer (magic, version or length)"
            dst = out[:length] if out is not None else aligned_empty(length)
            got, landed = pread_hash(fd, dst, 0)
        except OSError as exc:
            return None, 0, f"I/O error: {exc.strerror}"
        finally:
            os.close(fd)
        if got != length:
            return None, digest, "short read"
        if landed != digest:
            return None, digest, "checksum mismatch"
        return dst, digest, ""

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [os.path.isfile(self._file(key)) for key in keys]

    def keys(self) -> list[BlockKey]:
        """Every block file under the root (written by any node, in any earlier run)."""
        return stored_keys(self.root)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:
            file = self._file(key)
            try:
                size = os.stat(file).st_size - TRAILER.size
                os.unlink(file)
            except FileNotFoundError:
                continue
            n += 1
            if self._used is not None:
                self._used -= size
        self._stats.deletes += n
        return n

    _used: int | None = None

    @property
    def used_bytes(self) -> int:
        """Bytes of block files under the root: scanned once, then kept up to date by this writer."""
        if self._used is None:
            self._used = sum(_payload_bytes(p) for p in self.base.glob("??/??/*.kvb"))
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def stats(self) -> dict:
        return {"name": self.name, "medium": self.medium, "emulated": self.emulated,
                "used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes, **self._stats.__dict__}

    def check_integrity(self) -> None:
        for path in self.base.glob("??/??/*"):
            assert path.name.endswith(".kvb") or path.name.endswith(".tmp"), path
            assert path.resolve().parent.parent.parent == self.base


def stored_keys(root: str | Path) -> list[BlockKey]:
    """Keys of the block files a pfs tier rooted at `root` holds (none when it does not exist yet)."""
    out = []
    for path in (Path(root).resolve() / "kv").glob("??/??/*.kvb"):
        try:
            key = bytes.fromhex(path.stem)
        except ValueError:
            continue
        if len(key) == KEY_BYTES:
            out.append(BlockKey(key))
    return out


def _payload_bytes(path: Path) -> int:
    """A block file's payload bytes; 0 for one gone since it was listed: another writer of the directory (another
    replica, another node) deleted it, or a reader dropped it as corrupt."""
    try:
        return path.stat().st_size - TRAILER.size
    except FileNotFoundError:
        return 0


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """`data` at `offset` of `fd`, continued after a short write."""
    while data.nbytes:
        wrote = os.pwrite(fd, data, offset)
        if wrote == 0:
            raise OSError(errno.ENOSPC, "no space left for the block file")
        data, offset = data[wrote:], offset + wrote
