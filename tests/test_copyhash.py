"""The tiers' checksum: native and numpy agree, corruption changes it, large-batch paths verify it."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.keys import KeySpace
from kvcluster.storage import NVMeBackend, PFSBackend, StorageError, checksum, dram_backend
from kvcluster.storage import copyhash
from kvcluster.storage.parallel import BatchWorkers
from kvcluster.storage.rdma import _agent, progress_delay_us

SPACE = KeySpace(model="copyhash-test")
LENGTHS = [0, 1, 7, 31, 32, 33, 63, 64, 65, 4095, 4096, 65537, (256 << 10) + 3, 3_000_001]


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_the_native_kernel_is_built_here() -> None:
    """setup.sh compiles it on every machine with a C compiler (CI too); the fallback is for pip users without one."""
    assert copyhash.KERNEL in ("avx2", "base")


@pytest.mark.parametrize("n", LENGTHS)
def test_every_path_gives_the_numpy_digest(n: int, tmp_path: Path) -> None:
    data = random_bytes(n, n)
    want = copyhash._hash_py(data)
    dst = np.full(n + 9, 0xAB, dtype=np.uint8)
    assert copyhash.copy_hash(dst, data) == want and checksum(data) == want
    assert copyhash._copy_hash_py(np.empty(n, dtype=np.uint8), data) == want
    assert np.array_equal(dst[:n], data) and (dst[n:] == 0xAB).all()  # nothing written past the source
    path = tmp_path / "f"
    path.write_bytes(b"head" + data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        landing = np.empty(n + 100, dtype=np.uint8)  # room for more than the file holds: a short read
        assert copyhash.pread_hash(fd, landing, 4) == (n, want)
        assert np.array_equal(landing[:n], data)
        assert copyhash._pread_hash_py(fd, np.empty(n, dtype=np.uint8), 4) == (n, want)
    finally:
        os.close(fd)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=300))
def test_native_and_numpy_agree_on_any_bytes(data: bytes) -> None:
    assert copyhash.hash_bytes(data) == copyhash._hash_py(data)


def test_the_portable_kernel_agrees_with_the_avx2_one() -> None:
    code = ("import numpy as np; from kvcluster.storage import copyhash as c; "
            "d = np.random.default_rng(5).integers(0, 256, 1_000_003, dtype=np.uint8); "
            "print(c.KERNEL, c.hash_bytes(d), c.copy_hash(np.empty_like(d), d))")
    env = {**os.environ, "KVCLUSTER_NATIVE_KERNEL": "base"}
    kernel, a, b = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                  check=True).stdout.split()
    want = copyhash._hash_py(random_bytes(1_000_003, 5))
    assert kernel == "base" and int(a) == int(b) == want


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 8191), st.integers(0, 7))
def test_any_single_bit_flip_changes_the_digest(position: int, bit: int) -> None:
    data = random_bytes(8192, 1)
    flipped = data.copy()
    flipped[position] ^= np.uint8(1 << bit)
    assert checksum(flipped) != checksum(data)


def test_swapped_shifted_or_zeroed_data_changes_the_digest() -> None:
    data = random_bytes(1 << 16, 2)
    swapped = data.copy()
    swapped[:32], swapped[32:64] = data[32:64], data[:32]  # same words in the same lanes, other stripes
    zeroed = data.copy()
    zeroed[4096:8192] = 0
    longer = np.concatenate([data, np.zeros(1, dtype=np.uint8)])  # a zero tail: only the length differs
    digests = {checksum(d) for d in (data, swapped, np.roll(data, 8), zeroed, longer)}
    assert len(digests) == 5


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="destination holds 4 bytes"):
        copyhash.copy_hash(np.empty(4, dtype=np.uint8), b"12345")
    with pytest.raises(OSError):
        copyhash.pread_hash(-1, np.empty(4, dtype=np.uint8), 0)
    with pytest.raises(TypeError):
        copyhash.copy_hash(b"read-only", b"x")


def test_batch_workers_start_and_ahead_keep_order() -> None:
    workers = BatchWorkers(2)
    assert workers.worth(1 << 20) and not workers.worth(1000) and not BatchWorkers(1).worth(1 << 30)
    later = workers.ahead(lambda x: x * x, list(range(10)), 1 << 20)
    assert [get() for get in later] == [x * x for x in range(10)]
    assert workers.start(False, sum, [1, 2])() == 3


def big_batch(n: int = 4, block: int = 1 << 20, salt: str = "big"):
    """A batch above the threshold at which the file tiers share work with a second core."""
    return SPACE.chain_hash_ids(list(range(n)), cache_salt=salt), [random_bytes(block, i) for i in range(n)]


def test_nvme_pipeline_round_trips_and_catches_a_flipped_byte(tmp_path: Path) -> None:
    ks, data = big_batch()
    nvme = NVMeBackend(tmp_path, 8, 1 << 20)
    assert nvme._workers.worth(sum(d.nbytes for d in data))
    assert nvme.put_many(list(zip(ks, data))) == [True] * 4
    out = [np.empty(d.nbytes, dtype=np.uint8) for d in data]
    assert all(np.array_equal(g, d) for g, d in zip(nvme.get_many(ks, out), data))
    slot = nvme.table.get(ks[2]).slot
    with open(nvme.path, "r+b") as f:  # a second, buffered descriptor: the slab itself may be O_DIRECT
        f.seek(slot * nvme.slot_bytes + 12345)
        byte = f.read(1)[0]
        f.seek(slot * nvme.slot_bytes + 12345)
        f.write(bytes([byte ^ 0x10]))
        f.flush()
        os.fsync(f.fileno())
    os.posix_fadvise(nvme.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    got = nvme.get_many(ks, out)
    assert got[2] is None and all(np.array_equal(got[i], data[i]) for i in (0, 1, 3))
    assert nvme.stats()["corrupt"] == 1 and nvme.contains(ks) == [True, True, False, True]
    nvme.check_integrity()


def test_pfs_sums_on_another_core_and_stores_a_batch_duplicate_once(tmp_path: Path) -> None:
    ks, data = big_batch(salt="pfs")
    pfs = PFSBackend(tmp_path, 1 << 30)
    assert pfs.put_many(list(zip(ks, data)) + [(ks[0], data[0])]) == [True] * 5
    assert pfs.used_bytes == sum(d.nbytes for d in data) and pfs.stats()["puts"] == 4
    out = [np.empty(d.nbytes, dtype=np.uint8) for d in data]
    assert all(np.array_equal(g, d) for g, d in zip(pfs.get_many(ks, out), data))
    raw = bytearray(pfs.path_for(ks[1]).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    pfs.path_for(ks[1]).write_bytes(bytes(raw))
    assert pfs.get_many(ks[1:2]) == [None] and not pfs.path_for(ks[1]).exists()
    assert sorted(p.name for p in tmp_path.rglob(".*.tmp")) == []  # no temp file left behind


def test_old_format_pfs_files_are_misses(tmp_path: Path) -> None:
    (k,), (data,) = big_batch(1, 4096, "v1")
    pfs = PFSBackend(tmp_path, 1 << 20)
    pfs.put_many([(k, data)])
    raw = bytearray(pfs.path_for(k).read_bytes())
    raw[4:6] = (1).to_bytes(2, "little")  # version 1 held an xxh3 digest
    pfs.path_for(k).write_bytes(bytes(raw))
    assert pfs.get_many([k]) == [None]


def test_dram_pool_threads_a_large_batch_and_catches_corruption() -> None:
    ks, data = big_batch(8, 1 << 20, "dram")  # 8 MiB: split over the copy threads
    pool = dram_backend(8, 1 << 20)
    assert pool.put_many(list(zip(ks, data))) == [True] * 8
    pool._host[pool.table.get(ks[5]).slot, 777] ^= 0x80
    got = pool.get_many(ks, [np.empty(1 << 20, dtype=np.uint8) for _ in ks])
    assert got[5] is None and all(np.array_equal(got[i], data[i]) for i in range(8) if i != 5)
    pool.check_integrity()


def test_progress_delay_setting(monkeypatch) -> None:
    monkeypatch.delenv("KVCLUSTER_NIXL_PROGRESS_DELAY_US", raising=False)
    assert progress_delay_us() == 100
    monkeypatch.setenv("KVCLUSTER_NIXL_PROGRESS_DELAY_US", "0")
    assert progress_delay_us() == 0
    for bad in ("-5", "fast"):
        monkeypatch.setenv("KVCLUSTER_NIXL_PROGRESS_DELAY_US", bad)
        with pytest.raises(StorageError, match="KVCLUSTER_NIXL_PROGRESS_DELAY_US must be a whole number"):
            progress_delay_us()


def test_idle_nixl_agents_do_not_spin(monkeypatch) -> None:
    """NIXL's Python API makes its progress thread poll without pause; ours sleeps between idle polls."""
    monkeypatch.delenv("KVCLUSTER_NIXL_PROGRESS_DELAY_US", raising=False)
    pool, client = _agent("idle-pool-probe"), _agent("idle-client-probe")

    def cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    before, t0 = cpu_s(), time.monotonic()
    time.sleep(1.0)
    share = (cpu_s() - before) / (time.monotonic() - t0)
    del pool, client
    assert share < 0.3, f"two idle agents used {share:.2f} cores"
