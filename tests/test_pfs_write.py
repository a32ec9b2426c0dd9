"""pfs puts: a block file is whole after the write is cut short anywhere (payload or trailer), a payload that
differs from its given digest leaves no file at all, and two replicas writing one key never show a reader half a
file."""

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


def test_a_file_another_writer_deletes_while_a_replica_scans_its_used_bytes_counts_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica's first put scans the shared directory for its used bytes; a file the other replica deletes
    between the listing and its stat counts nothing (it raised FileNotFoundError out of the put)."""
    keys = SPACE.chain_hash_ids([60, 61])
    data = [np.full(8192, i, dtype=np.uint8) for i in range(2)]
    other = PFSBackend(tmp_path, 1 << 30)
    assert other.put_many(list(zip(keys, data))) == [True, True]
    real_glob = Path.glob

    def listed_then_one_deleted(self: Path, pattern: str):
        listed = list(real_glob(self, pattern))
        other.delete(keys[:1])
        return iter(listed)

    monkeypatch.setattr(Path, "glob", listed_then_one_deleted)
    replica = PFSBackend(tmp_path, 1 << 30)
    assert replica.used_bytes == 8192
    monkeypatch.undo()
    assert replica.put_many([(keys[0], data[0])]) == [True] and replica.used_bytes == 2 * 8192


RACE_KEY_IDS, RACE_BYTES, RACE_SEED = [55], 1 << 20, 55
RACING_WRITER = """
import json, sys
import numpy as np
from kvcluster.keys import KeySpace
from kvcluster.storage import PFSBackend
(key,) = KeySpace(model="pfs-write").chain_hash_ids({ids})
data = np.random.default_rng({seed}).integers(0, 255, {nbytes}, dtype=np.uint8)
pfs = PFSBackend(sys.argv[1], 1 << 30)
print("ready", flush=True)
sys.stdin.readline()
acked = 0
for _ in range(int(sys.argv[2])):
    pfs.delete([key])  # as a replica's tiers evict it: the next put writes the file again, racing the other's
    acked += pfs.put_many([(key, data)]) == [True]
print(json.dumps({{"acked": acked, **{{k: pfs.stats()[k] for k in ("puts", "put_failures", "corrupt")}}}}), flush=True)
""".format(ids=RACE_KEY_IDS, seed=RACE_SEED, nbytes=RACE_BYTES)


def test_two_replicas_racing_on_one_key_never_show_a_reader_half_a_file(tmp_path: Path) -> None:
    """Two processes (two replicas sharing the pfs tier) delete and write one key over and over while a third
    reads it: each read is a miss or the whole block, never a file caught half written (a corrupt read), and no
    temp file is left. Equal keys are equal bytes, so whichever rename lands last, the file is right."""
    import json
    import subprocess
    import sys

    (key,) = SPACE.chain_hash_ids(RACE_KEY_IDS)
    data = np.random.default_rng(RACE_SEED).integers(0, 255, RACE_BYTES, dtype=np.uint8)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    writers = [subprocess.Popen([sys.executable, "-c", RACING_WRITER, str(tmp_path), "300"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        assert [w.stdout.readline().strip() for w in writers] == ["ready", "ready"]
        reader = PFSBackend(tmp_path, 1 << 30)
        for w in writers:  # both start together
            w.stdin.write("go\n")
            w.stdin.flush()
        whole = missed = 0
        while any(w.poll() is None for w in writers):
            (got,) = reader.get_many([key])
            if got is None:
                missed += 1
            else:
                assert np.array_equal(got, data)
                whole += 1
        reports = [json.loads(w.stdout.readline()) for w in writers]
    finally:
        for w in writers:
            w.kill()
            w.wait(timeout=30)
    assert reader.stats()["corrupt"] == 0 and reader.stats()["gets"] == whole
    assert whole > 0 and missed > 0, (whole, missed)  # the reads did overlap the deletes and the writes
    assert all(r["acked"] == 300 and r["put_failures"] == 0 and r["corrupt"] == 0 for r in reports), reports
    assert sum(r["puts"] for r in reports) >= 300  # files written, not only found (each put follows a delete)
    assert not list(tmp_path.rglob("*.tmp"))
    assert np.array_equal(reader.get_many([key])[0], data)  # each writer's last call was a put
