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
from kvcluster.storage.aligned import PAGE, aligned_empty, aligned_host_tensor, is_aligned
from kvcluster.storage.copyhash import copy_hash
from kvcluster.storage.parallel import BatchWorkers
import torch

from kvcluster.storage import NixlPeerPool, RDMABackend
from kvcluster.storage import rdma
from kvcluster.storage.rdma import _agent, progress_delay_us, rdma_lanes

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
    for write, name in ((copyhash.pwrite_hash, "native"), (copyhash._pwrite_hash_py, "numpy")):
        fd = os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            assert write(fd, data, 5) == (n, want)  # at an offset, across several 256 KiB chunks for the largest
        finally:
            os.close(fd)
        assert (tmp_path / name).read_bytes() == (bytes(5) + data.tobytes() if n else b"")  # nothing to write


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=300))
def test_native_and_numpy_agree_on_any_bytes(data: bytes) -> None:
    assert copyhash.hash_bytes(data) == copyhash._hash_py(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=300), st.lists(st.integers(0, 300), max_size=6))
def test_scattered_segments_hash_as_the_one_buffer_they_make(data: bytes, cuts: list[int]) -> None:
    """A block in pieces (an engine's pages of it) has the digest of its bytes in one piece, however it is cut:
    stripes that straddle pieces, empty pieces and pieces shorter than a stripe included."""
    segments = np.split(np.frombuffer(data, dtype=np.uint8), sorted(min(c, len(data)) for c in cuts))
    want = copyhash._hash_py(data)
    assert copyhash.hash_segments(segments) == copyhash._hash_segments_py(segments) == want
    assert copyhash.hash_segments([torch.from_numpy(s.copy()).numpy() for s in segments]) == want


def test_the_portable_kernel_agrees_with_the_avx2_one() -> None:
    code = ("import numpy as np; from kvcluster.storage import copyhash as c; "
            "d = np.random.default_rng(5).integers(0, 256, 1_000_003, dtype=np.uint8); "
            "print(c.KERNEL, c.hash_bytes(d), c.copy_hash(np.empty_like(d), d), "
            "c.hash_segments(np.split(d, [5, 4096, 500_001])), "
            "c.pwrite_hash(__import__('os').open('/dev/null', 1), d, 0)[1])")
    env = {**os.environ, "KVCLUSTER_NATIVE_KERNEL": "base"}
    kernel, a, b, c, d = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                        check=True).stdout.split()
    want = copyhash._hash_py(random_bytes(1_000_003, 5))
    assert kernel == "base" and int(a) == int(b) == int(c) == int(d) == want


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
    with pytest.raises(OSError):
        copyhash.pwrite_hash(-1, b"1234", 0)
    with pytest.raises(TypeError):
        copyhash.copy_hash(b"read-only", b"x")


@pytest.mark.parametrize("make", [copyhash.hash_in_background, copyhash._SumsDone], ids=["native", "portable"])
def test_background_sums_give_each_buffers_digest_in_order(make) -> None:
    buffers = [random_bytes(n, seed=n) for n in LENGTHS]
    job = make(buffers)
    assert job.wait() == [copyhash._hash_py(b) for b in buffers] == job.wait()  # asked twice: the same list
    assert make([]).wait() == []


def test_background_sums_let_go_of_their_buffers_once_waited_for_or_freed() -> None:
    held = bytearray(random_bytes(1 << 20).tobytes())
    job = copyhash.hash_in_background([held])
    with pytest.raises(BufferError):
        held.extend(b"x")  # the summing thread may still read it: it cannot move
    assert job.wait() == [copyhash._hash_py(bytes(held))]
    held.extend(b"x")  # released by wait
    unwaited = copyhash.hash_in_background([held])
    del unwaited  # freed before anyone waited: it finishes reading, then lets go
    held.extend(b"y")
    with pytest.raises(TypeError):
        copyhash.hash_in_background([held, 7])  # not a buffer: a clear error, and the buffers taken are let go
    held.extend(b"z")


def test_background_sums_from_many_threads_each_get_their_own() -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(seed: int) -> bool:
        buffers = [random_bytes(70_000 + seed, seed=seed), random_bytes(33, seed=seed + 1)]
        return copyhash.hash_in_background(buffers).wait() == [copyhash._hash_py(b) for b in buffers]

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, range(40)))


def test_a_forked_child_sums_in_the_background_too(tmp_path: Path) -> None:
    """The summing thread does not survive a fork: the child starts its own instead of waiting on the parent's,
    and sums a job its parent had queued itself."""
    script = tmp_path / "fork.py"
    script.write_text(
        "import os, sys\n"
        "from kvcluster.storage import copyhash\n"
        "data = [bytes(range(256)) * 4096]\n"
        "want = [copyhash._hash_py(data[0])]\n"
        "assert copyhash.hash_in_background(data).wait() == want  # the parent's thread is up\n"
        "pending = copyhash.hash_in_background(data * 64)  # queued, maybe being summed, as the fork comes\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    fresh = copyhash.hash_in_background(data).wait() == want\n"
        "    os._exit(0 if fresh and pending.wait() == want * 64 else 3)\n"
        "assert pending.wait() == want * 64\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "child 0" in run.stdout, run.stderr[-2000:]


def test_batch_workers_start_and_ahead_keep_order() -> None:
    workers = BatchWorkers(2)
    assert workers.worth(1 << 20) and not workers.worth(1000) and not BatchWorkers(1).worth(1 << 30)
    later = workers.ahead(lambda x: x * x, list(range(10)), 1 << 20)
    assert [get() for get in later] == [x * x for x in range(10)]
    assert workers.start(False, sum, [1, 2])() == 3


def test_batch_workers_drain_runs_every_item_once_in_order() -> None:
    workers = BatchWorkers(2)
    assert workers.drain(lambda g, k: k * k, 7, 2) == [k * k for k in range(7)]
    assert workers.drain(lambda g, k: k, 0, 2) == []
    assert set(workers.drain(lambda g, k: g, 5, 1)) == {0}  # one lane: all in the calling thread


def test_batch_workers_drain_does_not_wait_for_a_late_lane() -> None:
    """A lane that has not started when the work runs out is cancelled: the caller took its share."""
    workers = BatchWorkers(2)
    gate = workers._executor().submit(time.sleep, 0.3)  # the only pool thread is busy: lane 1 cannot start
    assert workers.drain(lambda g, k: g, 4, 2) == [0, 0, 0, 0]
    assert not gate.done()  # drain returned without waiting for the pool thread (it would start after the gate)
    gate.result()


def test_batch_workers_drain_finishes_what_started_before_raising() -> None:
    workers = BatchWorkers(2)
    started, finished = [], []

    def item(g: int, k: int) -> int:
        started.append(k)
        if k == 0:
            time.sleep(0.2)  # lane 1 takes item 1 meanwhile
            raise ValueError("item 0 failed")
        time.sleep(0.3)
        finished.append(k)
        return k

    with pytest.raises(ValueError, match="item 0 failed"):
        workers.drain(item, 6, 2)
    assert finished == [1]  # item 1 was waited for: it may still have been writing the caller's buffers
    assert sorted(started) == [0, 1]  # nothing started after the error


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 30), st.integers(1, 4), st.lists(st.sampled_from([0.0, 0.0, 0.001]), min_size=1, max_size=8))
def test_batch_workers_drain_hands_each_item_to_one_lane(n: int, lanes: int, pauses: list[float]) -> None:
    workers = BatchWorkers(lanes)
    seen = []

    def item(g: int, k: int) -> tuple[int, int]:
        seen.append(k)
        time.sleep(pauses[k % len(pauses)])
        return g, k

    out = workers.drain(item, n, lanes)
    assert [k for _, k in out] == list(range(n)) and sorted(seen) == list(range(n))
    assert {g for g, _ in out} <= set(range(lanes))


def test_rdma_wakes_a_second_lane_only_for_a_large_batch() -> None:
    _, client, _, _ = _lanes_client("lanes-count", 2, 1 << 16)
    assert client._lanes([1 << 20], 1) == 1  # one chunk
    assert client._lanes([1 << 19] * 3, 2) == 1  # 1.5 MiB: one lane's worth
    assert client._lanes([1 << 20] * 2, 2) == 2
    assert client._lanes([1 << 20] * 8, 8) == 2  # no more than its agents
    assert client._lanes([1 << 20] * 4, 4, rdma.WRITE_LANE_MIN_BYTES) == 1  # a 4 MiB write: one lane
    assert client._lanes([1 << 20] * 16, 16, rdma.WRITE_LANE_MIN_BYTES) == 2


def test_rdma_lanes_setting(monkeypatch) -> None:
    monkeypatch.delenv("KVCLUSTER_RDMA_LANES", raising=False)
    assert 1 <= rdma_lanes() <= 2
    monkeypatch.setenv("KVCLUSTER_RDMA_LANES", "3")
    assert rdma_lanes() == 3
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv("KVCLUSTER_RDMA_LANES", bad)
        with pytest.raises(StorageError, match="KVCLUSTER_RDMA_LANES must be a whole number"):
            rdma_lanes()


def _lanes_client(name: str, n: int, block: int):
    pool = NixlPeerPool(n, block, name=f"{name}-pool")
    client = RDMABackend(pool, block, n, name=name, lanes=2)
    source, landing = torch.empty((n, block), dtype=torch.uint8), torch.zeros((n, block), dtype=torch.uint8)
    client.register(source)
    client.register(landing)
    return pool, client, source, landing


def test_rdma_lanes_share_a_large_batch_and_catch_corruption_in_any_chunk() -> None:
    ks, data = big_batch(6, block=1 << 20, salt="lanes")
    pool, client, source, landing = _lanes_client("lanes-client", 6, 1 << 20)
    assert client.stats()["lanes"] == 2 and len({a.name for a in client._agents}) == 2
    for row, d in zip(source.numpy(), data):
        row[:] = d
    assert client.put_many(list(zip(ks, source.numpy()))) == [True] * 6
    assert [e[2] for e in pool.lookup([bytes(k) for k in ks])] == [checksum(d) for d in data]  # digests line up
    out = list(landing.numpy())
    got = client.get_many(ks, out)
    assert all(np.array_equal(g, d) and np.shares_memory(g, o) for g, d, o in zip(got, data, out))
    for victim in (1, 4):  # blocks of two chunks (1 MiB blocks: a chunk each)
        pool.pool.numpy()[pool.lookup([bytes(ks[victim])])[0][0], 12345] ^= 0x04
    again = client.get_many(ks, out)
    assert again[1] is None and again[4] is None
    assert all(np.array_equal(again[i], data[i]) for i in (0, 2, 3, 5))
    assert client.contains(ks) == [True, False, True, True, False, True]  # the corrupt copies were dropped
    assert client.stats()["extra"] == {"direct_writes": 1, "direct_reads": 2}


def test_rdma_sums_a_large_put_on_the_summing_thread_and_commits_those_digests(monkeypatch) -> None:
    """New blocks of a batch from SUMS_AHEAD_MIN_BYTES on are summed in the background while they move; small
    batches and demotions (digests given) are not handed off. Each block commits its own digest either way."""
    ks, data = big_batch(6, block=1 << 20, salt="ahead")
    pool, client, source, _ = _lanes_client("ahead-client", 6, 1 << 20)
    client._cores = 2  # the background path even on a 1-core runner
    handed = []

    def recording(buffers):
        handed.append(len(buffers))
        return copyhash.hash_in_background(buffers)

    monkeypatch.setattr(rdma, "hash_in_background", recording)
    for row, d in zip(source.numpy(), data):
        row[:] = d
    rows = list(source.numpy())
    assert client.put_many(list(zip(ks[:2], rows[:2]))) == [True] * 2 and handed == []  # 2 MiB: inline
    assert client.put_many(list(zip(ks[2:], rows[2:])), [checksum(d) for d in data[2:]]) == [True] * 4
    assert handed == []  # a demotion's digests are known: nothing to sum
    client.delete(ks)
    given = [None, checksum(data[1]), None, None, None, None]
    assert client.put_many(list(zip(ks, rows)), given) == [True] * 6 and handed == [5]  # the 5 new ones
    assert [e[2] for e in pool.lookup([bytes(k) for k in ks])] == [checksum(d) for d in data]


def test_rdma_lanes_share_staged_batches_too(monkeypatch) -> None:
    """Buffers outside registered memory go through the staging buffer, part by part, each part over both lanes."""
    ks, data = big_batch(6, block=1 << 20, salt="lanes-staged")
    pool = NixlPeerPool(8, 1 << 20, name="lanes-staged-pool")
    client = RDMABackend(pool, 4 << 20, 8, name="lanes-staged", lanes=2)  # 4 blocks per staging part
    monkeypatch.setattr(rdma, "WRITE_LANE_MIN_BYTES", 1 << 20)  # writes of a 4 MiB part over both lanes
    used = []
    real = client._transfer

    def recording(op, pieces, lane=0, *where):
        used.append((op, lane, len(pieces)))
        if lane == 0:
            time.sleep(0.05)  # the calling thread is slow: lane 1 surely takes a chunk of each part
        return real(op, pieces, lane, *where)

    monkeypatch.setattr(client, "_transfer", recording)
    assert client.put_many(list(zip(ks, data))) == [True] * 6
    assert {lane for op, lane, _ in used if op == "WRITE"} == {0, 1}
    assert sum(n for op, _, n in used if op == "WRITE") == 6
    out = [np.empty(1 << 20, dtype=np.uint8) for _ in ks]
    got = client.get_many(ks, out)
    assert all(np.array_equal(g, d) and np.shares_memory(g, o) for g, d, o in zip(got, data, out))
    assert {lane for op, lane, _ in used if op == "READ"} == {0, 1}
    assert "direct_reads" not in client.stats()["extra"]  # staged, not straight into `out`
    pool.pool.numpy()[pool.lookup([bytes(ks[5])])[0][0], 4321] ^= 0x01  # in the second staging part
    again = client.get_many(ks)
    assert again[5] is None and all(np.array_equal(again[i], data[i]) for i in range(5))
    assert all(is_aligned(a) for a in again[:5])  # new arrays from a read are page-aligned


def test_closed_backends_give_up_their_agents_and_read_as_misses() -> None:
    """Agents go before the memory they registered (closed at exit too), and a closed client only misses."""
    from kvcluster.storage import rdma

    ks, data = big_batch(2, block=1 << 16, salt="closed")
    pool = NixlPeerPool(4, 1 << 16, name="closed-pool")
    client = RDMABackend(pool, 1 << 17, 4, name="closed-client", lanes=2)
    assert client.put_many(list(zip(ks, data))) == [True, True]
    assert client in rdma._OPEN and pool in rdma._OPEN
    client.close()
    client.close()  # idempotent
    assert client not in rdma._OPEN and client.get_many(ks) == [None, None]
    assert client.put_many(list(zip(ks, data))) == [False, False]
    pool.close()
    assert pool not in rdma._OPEN and pool.agent is None


def test_exit_with_live_agents_is_clean(tmp_path: Path) -> None:
    """A process that ends with clients, pools and registered memory alive exits 0 (agents torn down first)."""
    script = tmp_path / "live_at_exit.py"
    script.write_text(
        "import numpy as np, torch\n"
        "from kvcluster.keys import KeySpace\n"
        "from kvcluster.storage import NixlPeerPool, RDMABackend\n"
        "ks = KeySpace(model='exit').chain_hash_ids([0, 1, 2, 3])\n"
        "pool = NixlPeerPool(8, 1 << 20, name='exit-pool')\n"
        "client = RDMABackend(pool, 4 << 20, 8, name='exit-client', lanes=2)\n"
        "rows = torch.zeros((4, 1 << 20), dtype=torch.uint8)\n"
        "client.register(rows)\n"
        "assert all(client.put_many([(k, r) for k, r in zip(ks, rows.numpy())]))\n"
        "cycle = {'client': client}; cycle['self'] = cycle  # only the final collection would find these\n"
        "print('done')\n")
    for _ in range(3):
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "done" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_a_failed_lane_makes_the_whole_batch_a_miss(op: str, monkeypatch) -> None:
    ks, data = big_batch(4, block=1 << 20, salt=f"lane-fail-{op}")
    pool, client, source, landing = _lanes_client(f"lane-fail-{op.lower()}", 4, 1 << 20)
    monkeypatch.setattr(rdma, "WRITE_LANE_MIN_BYTES", 1 << 20)  # a 4 MiB write over both lanes
    for row, d in zip(source.numpy(), data):
        row[:] = d
    if op == "READ":
        assert client.put_many(list(zip(ks, source.numpy()))) == [True] * 4
    real = client._transfer

    def second_lane_fails(what, pieces, lane=0, *where):
        if what == op and lane == 0:
            time.sleep(0.2)  # lane 1 surely takes a chunk meanwhile
        if lane == 1 and what == op:
            raise StorageError(f"rdma: NIXL {what} failed (ERR)")
        return real(what, pieces, lane, *where)

    monkeypatch.setattr(client, "_transfer", second_lane_fails)
    if op == "WRITE":
        assert client.put_many(list(zip(ks, source.numpy()))) == [False] * 4
        assert pool.lookup([bytes(k) for k in ks]) == [None] * 4 and len(pool.table) == 0  # nothing committed
    else:
        assert client.get_many(ks, list(landing.numpy())) == [None] * 4
        assert client.contains(ks) == [True] * 4  # a failed read is a miss, not a reason to drop the peer's copies


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


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3 << 20))
def test_aligned_buffers_start_on_a_page(nbytes: int) -> None:
    buf = aligned_empty(nbytes)
    assert buf.nbytes == nbytes and buf.ctypes.data % PAGE == 0 and buf.dtype == np.uint8
    rows = aligned_host_tensor(3, 2 * PAGE)
    assert rows.shape == (3, 2 * PAGE) and all(is_aligned(row) for row in rows.numpy())
    assert dram_backend(2, 2 * PAGE).pool.data_ptr() % PAGE == 0  # a pool's rows go to disk in place


def _flip_on_disk(nvme: NVMeBackend, slot: int, offset: int) -> None:
    with open(nvme.path, "r+b") as f:  # a second, buffered descriptor: the slab itself may be O_DIRECT
        f.seek(slot * nvme.slot_bytes + offset)
        byte = f.read(1)[0]
        f.seek(slot * nvme.slot_bytes + offset)
        f.write(bytes([byte ^ 0x10]))
        f.flush()
        os.fsync(f.fileno())
    os.posix_fadvise(nvme.fd, 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.mark.parametrize("direct", [True, False])
def test_nvme_moves_aligned_blocks_in_place_and_still_verifies(tmp_path: Path, direct: bool, monkeypatch) -> None:
    """A pool's page-aligned rows are written and read without the staging copy; corruption is still a miss."""
    ks, data = big_batch(5, block=1 << 20, salt=f"in-place-{direct}")
    nvme = NVMeBackend(tmp_path, 8, 1 << 20, direct=direct)
    rows = aligned_host_tensor(5, 1 << 20).numpy()
    for row, d in zip(rows, data):
        row[:] = d
    staged = []
    real_copy = copy_hash

    def counting_copy_hash(dst, src):
        staged.append(src.nbytes)
        return real_copy(dst, src)

    monkeypatch.setattr("kvcluster.storage.nvme.copy_hash", counting_copy_hash)
    odd = random_bytes(3000, 9)  # neither aligned nor a whole page: staged even without O_DIRECT on a pool row
    items = list(zip(ks, rows)) + [(ks[0], rows[0])]  # ks[0] twice: stored once, both True
    assert nvme.put_many(items + [(SPACE.chain_hash_ids([99], cache_salt="odd")[0], odd)]) == [True] * 7
    assert staged == ([3000] if nvme.direct else [])  # buffered I/O takes any buffer in place
    staged.clear()
    landing = aligned_host_tensor(5, 1 << 20).numpy()
    got = nvme.get_many(ks, list(landing))
    assert all(np.array_equal(g, d) and np.shares_memory(g, row) for g, d, row in zip(got, data, landing))
    fresh = nvme.get_many(ks[:2])  # no `out`: new aligned arrays, read in place too
    assert all(is_aligned(g) and np.array_equal(g, d) for g, d in zip(fresh, data))
    assert staged == []  # nothing went through a staging buffer
    _flip_on_disk(nvme, nvme.table.get(ks[3]).slot, 777)
    again = nvme.get_many(ks, list(landing))
    assert again[3] is None and all(np.array_equal(again[i], data[i]) for i in (0, 1, 2, 4))
    assert nvme.stats()["corrupt"] == 1 and nvme.contains(ks) == [True, True, True, False, True]
    staged.clear()
    unaligned = [np.empty((1 << 20) + 1, dtype=np.uint8)[1:] for _ in range(2)]  # O_DIRECT cannot land these
    assert all(np.array_equal(g, d) for g, d in zip(nvme.get_many(ks[:2], unaligned), data))
    assert staged == ([1 << 20] * 2 if nvme.direct else [])
    with pytest.raises(ValueError, match=r"nvme: out\[0\] holds 4096 bytes"):  # too small: an error, not a miss
        nvme.get_many(ks[:1], [aligned_empty(4096)])
    assert nvme.contains(ks[:1]) == [True]  # and the block is still there
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
    with pytest.raises(ValueError, match=r"pfs: out\[1\] holds 4096 bytes"):  # too small: an error, not a miss
        pfs.get_many([ks[0], ks[2]], [out[0], np.empty(4096, dtype=np.uint8)])
    assert pfs.contains([ks[2]]) == [True] and pfs.stats()["corrupt"] == 1  # the shared file is still there


@pytest.mark.parametrize("version", [1, 2])  # 1: an xxh3 of the payload; 2: sums finalized with xxh3
def test_old_format_pfs_files_are_misses(tmp_path: Path, version: int) -> None:
    (k,), (data,) = big_batch(1, 4096, "v1")
    pfs = PFSBackend(tmp_path, 1 << 20)
    pfs.put_many([(k, data)])
    raw = bytearray(pfs.path_for(k).read_bytes())
    raw[4:6] = version.to_bytes(2, "little")
    pfs.path_for(k).write_bytes(bytes(raw))
    assert pfs.get_many([k]) == [None]


def test_a_change_in_any_one_sum_changes_the_digest() -> None:
    """The finalizer is a bijection of each sum with the others fixed: no single-sum change can collide."""
    from kvcluster.storage.copyhash import _digest

    base_a, base_b = np.arange(1, 5, dtype=np.uint64), np.arange(5, 9, dtype=np.uint64)
    digest = _digest(base_a, base_b, 4096)
    for lane in range(8):
        for flip in (1, 1 << 40, 1 << 63):
            a, b = base_a.copy(), base_b.copy()
            (a if lane < 4 else b)[lane % 4] ^= np.uint64(flip)
            assert _digest(a, b, 4096) != digest
    assert _digest(base_a, base_b, 4095) != digest  # the length is in it too


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
