"""pfs puts: a block file is whole after the write is cut short anywhere (payload or trailer), and a payload that
differs from its given digest leaves no file at all."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvcluster.keys import KeySpace
from kvcluster.storage import PFSBackend, checksum, copyhash
from kvcluster.storage import pfs as pfs_module

SPACE = KeySpace(model="pfs-write")


@pytest.mark.parametrize("cap", [7, 4096, 40_000])
def test_short_writes_are_continued_to_a_whole_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    cap: int) -> None:
    real = os.pwrite
    calls = []

    def short(fd: int, data, offset: int) -> int:  # a write the kernel cut after `cap` bytes
        calls.append(offset)
        return real(fd, bytes(data)[:cap], offset)

    monkeypatch.setattr(pfs_module.os, "pwrite", short)
    # the payload through the numpy twin of the native pwrite_hash, whose writes the kernel alone could cut
    monkeypatch.setattr(pfs_module, "pwrite_hash", copyhash._pwrite_hash_py)
    keys = SPACE.chain_hash_ids([1, 2])
    data = [np.random.default_rng(i).integers(0, 255, 100_003, dtype=np.uint8) for i in range(2)]
    pfs = PFSBackend(tmp_path, 1 << 30)
    assert pfs.put_many(list(zip(keys, data))) == [True, True]
    assert len(calls) > 4  # the cut writes were continued (payload and trailer of each file)
    monkeypatch.undo()
    assert all(np.array_equal(g, d) for g, d in zip(PFSBackend(tmp_path, 1 << 30).get_many(keys), data))


def test_a_payload_unlike_its_digest_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    keys = SPACE.chain_hash_ids([3, 4])
    data = [np.full(50_000, i, dtype=np.uint8) for i in range(2)]
    pfs = PFSBackend(tmp_path, 1 << 30)
    assert pfs.put_many(list(zip(keys, data)), [checksum(data[0]), checksum(data[0])]) == [True, False]
    assert pfs.contains(keys) == [True, False] and pfs.stats()["digest_mismatches"] == 1
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [f"{bytes(keys[0]).hex()}.kvb"]


def test_the_payload_starts_the_file_and_a_file_with_a_header_first_is_a_miss(tmp_path: Path) -> None:
    """The payload at offset 0 (page-aligned writes), the trailer after it; a file laid out as before version 4
    (the same fields as a header before the payload) fails the trailer's checks: a miss, and removed."""
    import struct

    (key,) = SPACE.chain_hash_ids([5])
    data = np.random.default_rng(5).integers(0, 255, 8192, dtype=np.uint8)
    pfs = PFSBackend(tmp_path, 1 << 30)
    assert pfs.put_many([(key, data)]) == [True]
    raw = pfs.path_for(key).read_bytes()
    assert raw[:8192] == data.tobytes()
    assert struct.unpack("<4sHxxQQ", raw[8192:]) == (b"KVCB", 4, 8192, checksum(data))
    old = struct.pack("<4sHxxQQ", b"KVCB", 3, 8192, checksum(data)) + data.tobytes()
    pfs.path_for(key).write_bytes(old)
    assert pfs.get_many([key]) == [None] and not pfs.path_for(key).exists()


def test_a_large_batch_spread_over_the_cores_stores_each_block_whole_and_refuses_the_changed_one(
        tmp_path: Path) -> None:
    """12 MiB: past PARALLEL_MIN_BYTES, so the files are written on several lanes; the counts stay exact."""
    from kvcluster.storage.parallel import PARALLEL_MIN_BYTES

    keys = SPACE.chain_hash_ids(list(range(10, 16)))
    data = [np.random.default_rng(i).integers(0, 255, 2 << 20, dtype=np.uint8) for i in range(6)]
    assert sum(d.nbytes for d in data) >= PARALLEL_MIN_BYTES
    digests = [checksum(d) for d in data]
    digests[3] ^= 1  # block 3 changed since its digest was taken
    pfs = PFSBackend(tmp_path, 1 << 30)
    assert pfs.put_many(list(zip(keys, data)), digests) == [True, True, True, False, True, True]
    stats = pfs.stats()
    assert (stats["puts"], stats["put_failures"], stats["digest_mismatches"]) == (5, 1, 1)
    assert stats["used_bytes"] == 5 * (2 << 20)
    got = PFSBackend(tmp_path, 1 << 30).get_many(keys)
    assert [g is not None and np.array_equal(g, d) for g, d in zip(got, data)] == [True] * 3 + [False] + [True] * 2
    assert not list(tmp_path.rglob("*.tmp"))
