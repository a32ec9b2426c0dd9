"""The shared-filesystem tier: content-addressed block files under one root.

Layout: `ROOT/kv/ab/cd/<32 hex key>.kvb`, the path derived only from the key
(never from user text) and checked to stay under ROOT. Each file is a header
(magic, version, payload length, xxh3-64) plus the payload, written to a unique
temp name in the same directory and renamed into place: concurrent writers of
the same key on several nodes leave exactly one complete file, and a reader
never sees a partial one. A key already on file is not written again (equal keys
mean equal KV), so a popular prefix written back by many replicas costs one
file. A file that fails its checks is a miss and is removed, and the next put
writes it afresh.
"""

from __future__ import annotations

import os
import struct
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np

from ..keys import KEY_BYTES, BlockKey
from .base import BackendStats, Payload, StorageBackend, StorageError, checksum

MAGIC = b"KVCB"
HEADER = struct.Struct("<4sHxxQQ")  # magic, version, length, checksum
VERSION = 1


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
        self._dirs: set[Path] = set()
        self._stats = BackendStats()

    def path_for(self, key: BlockKey) -> Path:
        if len(key) != KEY_BYTES:
            raise ValueError(f"block keys are {KEY_BYTES}-byte digests, got {len(key)} bytes")
        hexkey = bytes(key).hex()  # [0-9a-f] only: no separator, no "..", cannot leave base
        return self.base / hexkey[:2] / hexkey[2:4] / f"{hexkey}.kvb"

    def put_many(self, items: Sequence[tuple[BlockKey, Payload]]) -> list[bool]:
        ok = []
        for key, data in items:
            view = memoryview(data).cast("B")
            if self.used_bytes + view.nbytes > self._capacity:
                self._stats.put_failures += 1
                ok.append(False)
                continue
            path = self.path_for(key)
            if path.exists():  # content-addressed: equal keys hold equal bytes, so another writer's copy serves
                self._stats.extra["already_stored"] = self._stats.extra.get("already_stored", 0) + 1
                ok.append(True)
                continue
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            try:
                if path.parent not in self._dirs:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    self._dirs.add(path.parent)
                with open(tmp, "wb") as f:
                    f.write(HEADER.pack(MAGIC, VERSION, view.nbytes, checksum(view)))
                    f.write(view)
                os.replace(tmp, path)
            except OSError:  # no space, read-only or vanished mount: this block stays a miss
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
                self._stats.put_failures += 1
                ok.append(False)
                continue
            self._stats.puts += 1
            self._stats.put_bytes += view.nbytes
            if self._used is not None:
                self._used += view.nbytes
            ok.append(True)
        return ok

    def get_many(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray | None]:
        results: list[np.ndarray | None] = []
        for i, key in enumerate(keys):
            path = self.path_for(key)
            try:
                dst = self._read(path, None if out is None else out[i])
            except FileNotFoundError:
                self._stats.misses += 1
                results.append(None)
                continue
            if dst is None:
                self._stats.corrupt += 1
                try:
                    path.unlink(missing_ok=True)
                except OSError:  # a read-only mount: the bad file stays, and stays a miss on every read
                    pass
                results.append(None)
                continue
            self._stats.gets += 1
            self._stats.get_bytes += dst.nbytes
            results.append(dst)
        return results

    @staticmethod
    def _read(path: Path, out: np.ndarray | None) -> np.ndarray | None:
        """Header and payload in one preadv, straight into `out`; None when the file fails any check."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise
        except OSError:
            return None
        try:
            length = os.fstat(fd).st_size - HEADER.size
            if length < 0 or (out is not None and out.nbytes < length):
                return None
            dst = out[:length] if out is not None else np.empty(length, dtype=np.uint8)
            header = bytearray(HEADER.size)
            got = os.preadv(fd, [header, dst], 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        magic, version, stored_length, digest = HEADER.unpack(header)
        if got != HEADER.size + length or (magic, version, stored_length) != (MAGIC, VERSION, length):
            return None
        return dst if checksum(dst) == digest else None

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [self.path_for(key).is_file() for key in keys]

    def keys(self) -> list[BlockKey]:
        """Every block file under the root (written by any node, in any earlier run)."""
        out = []
        for path in self.base.glob("??/??/*.kvb"):
            try:
                key = bytes.fromhex(path.stem)
            except ValueError:
                continue
            if len(key) == KEY_BYTES:
                out.append(BlockKey(key))
        return out

    def delete(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:
            path = self.path_for(key)
            try:
                size = path.stat().st_size - HEADER.size
                path.unlink()
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
            self._used = sum(p.stat().st_size - HEADER.size for p in self.base.glob("??/??/*.kvb"))
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
