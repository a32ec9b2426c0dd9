"""Tier backends move real bytes exactly, catch corruption, and fail cleanly."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcluster.keys import BlockKey, KeySpace
from kvcluster.model_spec import load_model_spec
from kvcluster.storage import (NVMeBackend, NixlPeerPool, PFSBackend, RDMABackend, StorageError, checksum,
                               cxl_backend, dram_backend, hbm_backend, layout_for)
from kvcluster.storage.aligned import aligned_empty
from kvcluster.storage.rdma import PeerUnavailable

SPACE = KeySpace(model="test")


def keys(n: int, salt: str = "") -> list:
    return SPACE.chain_hash_ids(list(range(n)), cache_salt=salt)


def payloads(dtype: torch.dtype, n: int, numel: int = 4096) -> list[np.ndarray]:
    """Random KV in `dtype`, as raw bits (bf16 moves as uint16, fp8 as uint8)."""
    torch.manual_seed(1)
    out = []
    for _ in range(n):
        t = torch.randn(numel).to(dtype)
        bits = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[t.element_size()]
        out.append(t.view(bits).numpy().view(np.uint8).copy())
    return out


def backends(tmp_path: Path):
    yield hbm_backend(16, 1 << 14)
    yield dram_backend(16, 1 << 14)
    yield cxl_backend(16, 1 << 14)
    yield NVMeBackend(tmp_path / "nvme", 16, 1 << 14)
    yield PFSBackend(tmp_path / "pfs", 1 << 20)
    pool = NixlPeerPool(16, 1 << 14)
    yield RDMABackend(pool, 1 << 16, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_every_backend_round_trips_bits_exactly(tmp_path: Path, dtype) -> None:
    data = payloads(dtype, 5, numel=1024 if dtype == torch.float32 else 2048)
    ks = keys(5, str(dtype))
    for backend in backends(tmp_path / str(dtype).split(".")[-1]):
        assert backend.put_many(list(zip(ks, data))) == [True] * 5, backend.name
        out = [np.empty(d.nbytes, dtype=np.uint8) for d in data]
        got = backend.get_many(ks, out)
        assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data)), backend.name
        assert backend.contains(ks) == [True] * 5
        assert backend.delete(ks[:2]) == 2 and backend.get_many(ks[:2]) == [None, None]
        backend.check_integrity()
        assert {"name", "medium", "emulated"} <= set(backend.stats())


def _registered_rdma(n: int, block: int):
    """An rdma client whose payloads and landing rows lie in registered memory: the direct path."""
    client = RDMABackend(NixlPeerPool(2 * n, block), block, 2 * n, lanes=1)
    rows = torch.zeros((2, n, block), dtype=torch.uint8)
    client.register(rows)
    client._rows = rows  # kept alive with the client
    return client, rows.numpy()[0], rows.numpy()[1]


def test_verified_digests_come_with_every_read(tmp_path: Path) -> None:
    data = payloads(torch.bfloat16, 3, numel=2048)
    ks = keys(3, "verified")
    for backend in backends(tmp_path):
        assert backend.put_many(list(zip(ks, data))) == [True] * 3
        got, digests = backend.read_verified(ks + keys(1, "never-stored"))
        assert all(np.array_equal(g, d) for g, d in zip(got, data)) and got[3] is None
        if backend.name == "hbm":  # the tier the model reads directly keeps no checksum
            assert digests == [None] * 4
        else:
            assert digests == [checksum(d) for d in data] + [None], backend.name


def test_a_given_digest_is_stored_and_a_payload_that_changed_is_never_served(tmp_path: Path) -> None:
    """Every backend takes a demoted block's verified digest; bytes that no longer match it are a miss."""
    data = payloads(torch.float32, 2, numel=4096)  # 16 KiB each
    ks = keys(2, "given")
    wrong = [checksum(data[0]), checksum(data[1]) ^ 1]  # block 1's bytes changed since they were verified
    rdma, rows, landing = _registered_rdma(2, 1 << 14)
    rows[:] = np.stack(data)
    aligned = [aligned_empty(d.nbytes) for d in data]
    for a, d in zip(aligned, data):
        a[:] = d
    cases = [(b, data) for b in backends(tmp_path)] + [(rdma, list(rows)),  # direct: the digest is not summed again
                                                       (NVMeBackend(tmp_path / "in-place", 4, 1 << 14), aligned)]
    for backend, items in cases:
        stored = backend.put_many(list(zip(ks, items)), wrong)
        got = backend.get_many(ks)
        assert stored[0] and np.array_equal(got[0], data[0]), backend.name
        if backend.name == "hbm":  # keeps no checksum: the digest means nothing to it, the bytes are stored
            assert stored[1] and np.array_equal(got[1], data[1])
            continue
        assert got[1] is None, backend.name  # refused at the put (it summed the copy) or caught by the read
        assert (stored[1] is False) == (backend.stats()["digest_mismatches"] == 1), backend.name
        if backend is not rdma:  # every tier but a DMA-style write sums what it stores: refused at the put
            assert stored[1] is False and backend.stats()["digest_mismatches"] == 1, backend.name
    # moved from registered memory without a pass of its own: stored as given, caught by the read
    assert rdma.stats()["digest_mismatches"] == 0 and rdma.stats()["corrupt"] == 1
    with pytest.raises(ValueError, match="1 digests for 2 items"):
        dram_backend(4, 1 << 14).put_many(list(zip(ks, data)), [None])


def test_a_demotion_hands_the_tier_below_the_digest_it_verified(tmp_path: Path) -> None:
    from kvcluster.policies.base import RequestContext
    from kvcluster.storage.tiered import TieredStore

    data = payloads(torch.float32, 4, numel=1024)
    ks = keys(4, "demote")
    lower = NVMeBackend(tmp_path / "nvme", 8, 4096)
    handed = []
    real = lower.put_many

    def spy(items, digests=None):
        handed.extend(zip([bytes(k) for k, _ in items], digests))
        return real(items, digests)

    lower.put_many = spy
    store = TieredStore([dram_backend(2, 4096), lower], 4096, "lru")
    for i, (k, d) in enumerate(zip(ks, data)):  # two blocks fit in dram: the first two go down
        store.commit([k], [d], RequestContext(i, float(i)))
    assert handed == [(bytes(ks[0]), checksum(data[0])), (bytes(ks[1]), checksum(data[1]))]
    assert all(np.array_equal(p, d) for p, d in zip(store.fetch(ks).payloads, data))


def test_stand_ins_say_so(tmp_path: Path) -> None:
    assert hbm_backend(1, 64).emulated == (not torch.cuda.is_available())
    cxl = cxl_backend(1, 64)
    assert cxl.emulated and "emulated" in cxl.medium or not cxl.emulated
    nvme = NVMeBackend(tmp_path, 1, 64)
    assert any(p in nvme.medium for p in ("kvikio", "posix-odirect", "posix-buffered"))


def test_full_pools_refuse_and_leave_a_miss(tmp_path: Path) -> None:
    for backend in (dram_backend(2, 1 << 12), NVMeBackend(tmp_path, 2, 1 << 12), PFSBackend(tmp_path / "p", 3 << 12)):
        ks, data = keys(4, backend.name), payloads(torch.float32, 4, numel=1024)
        ok = backend.put_many(list(zip(ks, data)))
        assert ok[:2] == [True, True] and ok[3] is False
        assert backend.get_many(ks[3:]) == [None]
        too_big = np.zeros((1 << 12) + 1, dtype=np.uint8)
        assert backend.put_many([(keys(1, "big")[0], too_big)]) == [False] or backend.name == "pfs"
        backend.check_integrity()


def test_flipped_byte_on_disk_is_a_miss(tmp_path: Path, caplog) -> None:
    caplog.set_level("WARNING", logger="kvcluster.storage")
    data = payloads(torch.bfloat16, 1)[0]
    k = keys(1)[0]
    nvme = NVMeBackend(tmp_path / "n", 4, 1 << 14)
    nvme.put_many([(k, data)])
    slot = nvme.table.get(k).slot
    with open(nvme.path, "r+b") as f:
        f.seek(slot * nvme.slot_bytes + 100)
        byte = f.read(1)
        f.seek(slot * nvme.slot_bytes + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    assert nvme.get_many([k]) == [None] and nvme.stats()["corrupt"] == 1 and not nvme.contains([k])[0]
    pfs = PFSBackend(tmp_path / "p", 1 << 20)
    pfs.put_many([(k, data)])
    path = pfs.path_for(k)
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x01
    path.write_bytes(bytes(raw))
    assert pfs.get_many([k]) == [None] and not path.exists()
    assert pfs.get_many([k]) == [None]  # dropped: a plain miss now, not logged again
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcluster.storage"]
    assert lines == [f"nvme: block {bytes(k).hex()} read as corrupt and dropped (checksum mismatch)",
                     f"pfs: block {bytes(k).hex()} read as corrupt and dropped (checksum mismatch)"]


def _pfs_writer(root: str, race_keys: list[bytes], fill: int) -> None:
    backend = PFSBackend(root, 1 << 30)
    data = np.full(1 << 16, fill, dtype=np.uint8)
    for key in race_keys:  # every writer puts every key: each key is a race among the three
        backend.put_many([(BlockKey(key), data)])


def test_concurrent_pfs_writers_leave_one_valid_file(tmp_path: Path) -> None:
    race = keys(30, "race")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_pfs_writer, args=(str(tmp_path), [bytes(k) for k in race], fill))
             for fill in (1, 2, 3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    backend = PFSBackend(tmp_path, 1 << 30)
    for got in backend.get_many(race):
        assert got is not None and len(set(got.tolist())) == 1 and got[0] in (1, 2, 3)
    assert sorted(tmp_path.glob("kv/*/*/*")) == sorted(backend.path_for(k) for k in race)  # no temp files left


def test_a_key_already_on_pfs_is_not_written_again(tmp_path: Path) -> None:
    pfs = PFSBackend(tmp_path, 1 << 20)
    (k,) = keys(1, "dedup")
    assert pfs.put_many([(k, np.full(4096, 7, dtype=np.uint8))]) == [True]
    before = pfs.path_for(k).stat().st_mtime_ns, pfs.used_bytes
    assert pfs.put_many([(k, np.full(4096, 7, dtype=np.uint8))]) == [True]
    assert (pfs.path_for(k).stat().st_mtime_ns, pfs.used_bytes) == before
    assert pfs.stats()["extra"]["already_stored"] == 1
    raw = bytearray(pfs.path_for(k).read_bytes())
    raw[-1] ^= 0xFF
    pfs.path_for(k).write_bytes(bytes(raw))
    assert pfs.get_many([k]) == [None]  # the corrupt copy is dropped on read ...
    assert pfs.put_many([(k, np.full(4096, 7, dtype=np.uint8))]) == [True]
    assert pfs.get_many([k])[0].tolist() == [7] * 4096  # ... and the next put writes it afresh


def test_unwritable_directories_give_clear_errors(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.access(locked, os.W_OK):  # root ignores mode bits: use a path under a regular file instead
        locked = tmp_path / "file"
        locked.write_text("x")
    with pytest.raises(StorageError, match="pfs: cannot write under"):
        PFSBackend(locked / "pfs", 1 << 20)
    with pytest.raises(StorageError, match="nvme: cannot open a slab file"):
        NVMeBackend(locked / "nvme", 4, 4096)
    with pytest.raises(StorageError, match="not enough free space|cannot reserve"):
        NVMeBackend(tmp_path / "huge", 1 << 20, 1 << 30)  # 1 PiB


def test_pfs_paths_come_only_from_keys(tmp_path: Path) -> None:
    pfs = PFSBackend(tmp_path, 1 << 20)
    path = pfs.path_for(keys(1)[0])
    assert path.is_relative_to(tmp_path.resolve()) and path.name.endswith(".kvb")
    with pytest.raises(ValueError):
        pfs.path_for(b"../etc/passwd")  # not a digest: refused
    odd = pfs.path_for(b"../../etc/pas\x00\x00\x00")  # any 16 bytes map to hex under the root
    assert odd.is_relative_to(tmp_path.resolve()) and set(odd.stem) <= set("0123456789abcdef")


def test_layouts_per_attention_kind() -> None:
    gqa = layout_for(load_model_spec("llama-3.1-8b"), 16, "bf16")
    assert gqa.shape() == (32, 2, 8, 16, 128) and gqa.nbytes() == 16 * 131072 and gqa.shards == 8
    payload = np.arange(gqa.nbytes() // 2, dtype=np.uint16).view(np.uint8)
    shard = gqa.shard(payload, 3)
    assert shard.shape == (32, 2, 16, 128) and not shard.flags["C_CONTIGUOUS"]  # a view, not a copy
    assert np.shares_memory(shard, payload)
    mla = layout_for(load_model_spec("deepseek-v3"), 16, "bf16")
    assert mla.kind == "latent" and mla.shape() == (61, 16, 576) and mla.shards == 1
    mistral = layout_for(load_model_spec("mistral-7b-v0.1"), 16)
    assert mistral.layers_needed(0, 16) == mistral.layers and mistral.layers_needed(0, 10_000) == ()
    gemma = layout_for(load_model_spec("gemma-3-27b"), 16)
    assert len(gemma.layers_needed(0, 100_000)) == 10  # only the global layers still need an old block


class _PipePeer:
    """Client side of a pool in another process: control calls over a pipe, bytes over NIXL."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def __getattr__(self, method):
        def call(*args):
            self.conn.send((method, args))
            return self.conn.recv()

        return call


def _serve_pool(conn) -> None:
    pool = NixlPeerPool(32, 1 << 16, name="peer-b")
    while True:
        method, args = conn.recv()
        if method == "stop":
            conn.send(pool.usage())
            return
        conn.send(getattr(pool, method)(*args))


def test_rdma_moves_blocks_between_two_processes() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_pool, args=(child,))
    proc.start()
    try:
        backend = RDMABackend(_PipePeer(parent), staging_bytes=1 << 18, slots=32, name="client-a")
        data = payloads(torch.bfloat16, 8, numel=20_000)
        ks = keys(8, "rdma")
        assert backend.put_many(list(zip(ks, data))) == [True] * 8  # 8 x 40 KB over a 256 KiB staging buffer
        got = backend.get_many(ks)
        assert all(np.array_equal(g, d) for g, d in zip(got, data))
        assert backend.used_bytes == 8 * (1 << 16) and "via NIXL UCX over" in backend.medium
    finally:
        parent.send(("stop", ()))
        parent.recv()
        proc.join(30)


def _serve_pool_with_corruption(conn) -> None:
    pool = NixlPeerPool(32, 1 << 16, name="peer-c")
    while True:
        method, args = conn.recv()
        if method == "stop":
            conn.send(None)
            return
        if method == "flip":  # a bit flips in the peer's memory after the block was committed
            pool.pool[pool.table.get(BlockKey(args[0])).slot, 5] ^= 0x01
            conn.send(None)
            continue
        conn.send(getattr(pool, method)(*args))


def test_rdma_moves_registered_memory_without_staging_and_still_verifies() -> None:
    """Blocks sent from and landed in registered memory (a tier's own pool) skip the staging copy."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_pool_with_corruption, args=(child,))
    proc.start()
    try:
        backend = RDMABackend(_PipePeer(parent), staging_bytes=1 << 16, slots=32, name="client-d")
        block = 40_000
        source, landing = torch.zeros((8, 1 << 16), dtype=torch.uint8), torch.zeros((8, 1 << 16), dtype=torch.uint8)
        backend.register(source)
        backend.register(landing)
        data = payloads(torch.float8_e4m3fn, 8, numel=block)
        for row, d in zip(source.numpy(), data):
            row[:block] = d
        ks = keys(8, "direct")
        assert backend.put_many([(k, row[:block]) for k, row in zip(ks, source.numpy())]) == [True] * 8
        out = list(landing.numpy())
        got = backend.get_many(ks, out)
        assert all(np.array_equal(g, d) and np.shares_memory(g, o) for g, d, o in zip(got, data, out))
        stats = backend.stats()["extra"]
        assert stats == {"direct_writes": 1, "direct_reads": 1}  # 320 KB moved past a 64 KiB staging buffer
        parent.send(("flip", (bytes(ks[3]),)))
        parent.recv()
        again = backend.get_many(ks, out)
        assert again[3] is None and all(a is not None for i, a in enumerate(again) if i != 3)
        assert backend.contains(ks)[3] is False  # the corrupt copy was dropped at the peer
        plain = backend.get_many(ks[:2])  # buffers outside registered memory: through staging, same bytes
        assert all(np.array_equal(g, d) for g, d in zip(plain, data)) and backend.stats()["extra"]["direct_reads"] == 2
    finally:
        parent.send(("stop", ()))
        parent.recv()
        proc.join(30)


class _FailingPeer:
    """A peer pool whose owner disappears at a chosen control call."""

    def __init__(self, pool: NixlPeerPool, fail_on: str) -> None:
        self.pool, self.fail_on = pool, fail_on

    def __getattr__(self, method: str):
        if method == self.fail_on:
            def gone(*args):
                raise PeerUnavailable(f"{method}: owner gone")
            return gone
        return getattr(self.pool, method)


@pytest.mark.parametrize("fail_on", ["reserve", "commit", "lookup", "release"])
def test_a_peer_lost_mid_call_gives_misses_not_errors(fail_on: str) -> None:
    ks = keys(3, "peer-lost")
    data = [np.full(1 << 12, i, dtype=np.uint8) for i in range(3)]
    pool = NixlPeerPool(8, 1 << 14, name=f"lost-{fail_on}")
    backend = RDMABackend(_FailingPeer(pool, fail_on), 1 << 16, 8, name=f"lost-client-{fail_on}")
    stored = backend.put_many(list(zip(ks, data)))
    if fail_on in ("reserve", "commit"):
        assert stored == [False] * 3 and backend.get_many(ks) == [None] * 3  # nothing half-written is readable
        return
    assert stored == [True] * 3
    if fail_on == "lookup":
        assert backend.get_many(ks) == [None] * 3 and backend.contains(ks) == [False] * 3
    else:  # release is only called for corrupt blocks: flip a byte in the owner's slab
        host = pool.pool.numpy()
        host[pool.lookup([bytes(ks[0])])[0][0], 0] ^= 0xFF
        got = backend.get_many(ks)
        assert got[0] is None and all(np.array_equal(g, d) for g, d in zip(got[1:], data[1:]))


@pytest.mark.parametrize("make", [dram_backend, cxl_backend])
def test_a_large_batch_spread_over_threads_round_trips_and_catches_corruption(make) -> None:
    """Batches past PARALLEL_MIN_BYTES copy and hash on several threads: same bytes, same miss on a flipped bit."""
    block = 2 << 20
    backend = make(8, block)
    backend._workers.workers = max(backend._workers.workers, 2)  # the threaded path even on a 1-core runner
    ks = keys(5, "threads")
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, block, dtype=np.uint8) for _ in ks]
    items = list(zip(ks, data)) + [(ks[0], data[4])]  # ks[0] twice: the later payload wins
    assert backend.put_many(items) == [True] * 6
    out = [np.empty(block, dtype=np.uint8) for _ in ks]
    got = backend.get_many(ks, out)
    assert np.array_equal(got[0], data[4]) and all(np.array_equal(g, d) for g, d in zip(got[1:], data[1:]))
    assert all(np.shares_memory(g, o) for g, o in zip(got, out))  # landed in the caller's buffers
    backend._host[backend.table.get(ks[2]).slot, 100] ^= 0x10
    again = backend.get_many(ks)
    assert again[2] is None and all(a is not None for i, a in enumerate(again) if i != 2)
    assert backend.stats()["corrupt"] == 1 and ks[2] not in backend.table
    backend.check_integrity()


def test_reservations_of_a_writer_that_died_expire_and_free_their_slots() -> None:
    from kvcluster.storage.rdma import RESERVATION_TTL_S

    pool = NixlPeerPool(2, 1 << 12, name="ttl-peer")
    ks = [bytes(k) for k in keys(3, "ttl")]
    first = pool.reserve(ks[:2], [100, 100], now=0.0)  # a writer reserves both slots, then dies
    assert None not in first and len(set(first)) == 2 and pool.pending == 2
    assert pool.reserve(ks[2:], [100], now=1.0) == [None]  # full while those reservations stand
    (late,) = pool.reserve(ks[2:], [100], now=RESERVATION_TTL_S + 1)  # expired: the slots are free again
    assert late is not None and pool.pending == 1
    pool.commit(ks[:1], [first[0]], [100], [0])  # the dead writer's late commit makes nothing readable
    assert pool.lookup(ks[:1]) == [None]
    pool.commit(ks[2:], [late], [100], [7])
    assert pool.lookup(ks[2:]) == [(late, 100, 7)] and pool.pending == 0
    pool.table.check_integrity()


def test_the_rdma_medium_names_what_ucx_can_use(tmp_path: Path, monkeypatch) -> None:
    """No RDMA adapter: a stand-in (TCP or shared memory); an adapter UCX may use: real RDMA."""
    from kvcluster.storage.rdma import ucx_transport

    monkeypatch.delenv("UCX_TLS", raising=False)
    assert ucx_transport(tmp_path / "absent") == ("TCP or shared memory (no RDMA device)", True)
    (tmp_path / "mlx5_0").mkdir()
    assert ucx_transport(tmp_path) == ("RDMA verbs (mlx5_0)", False)
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    assert ucx_transport(tmp_path) == ("TCP or shared memory (RDMA left out by UCX_TLS, UCX_TLS=tcp,self)", True)
    monkeypatch.setenv("UCX_TLS", "rc,sm")
    assert ucx_transport(tmp_path) == ("RDMA verbs (mlx5_0, UCX_TLS=rc,sm)", False)


def test_a_full_nvme_tier_keeps_a_batchs_first_blocks_whichever_way_each_is_written(tmp_path: Path) -> None:
    """Page-aligned payloads go to the disk in place, others through a staging buffer, in two passes: the
    blocks that get the last free slots must still be the batch's first (a request's prefix), not the aligned."""
    backend = NVMeBackend(tmp_path, 2, 1 << 12)
    ks = keys(4, "order")
    raw = aligned_empty(6 << 12)
    staged = [raw[1 + (j << 12): 1 + ((j + 1) << 12)] for j in range(2)]  # off the page: staged
    in_place = [raw[(j + 3) << 12: (j + 4) << 12] for j in range(2)]  # whole pages: written in place
    for j, view in enumerate(staged + in_place):
        view[:] = j + 1
    assert backend.put_many(list(zip(ks, staged + in_place))) == [True, True, False, False]
    assert [None if p is None else int(p[0]) for p in backend.get_many(ks)] == [1, 2, None, None]
    assert backend.stats()["put_failures"] == 2
    backend.check_integrity()


def test_a_payload_check_while_another_thread_is_still_importing_torch_is_no_error(monkeypatch, tmp_path) -> None:
    """A file tier loads torch on first use, maybe in one thread while another stores: torch is in sys.modules
    from the start of its import, its names only later. Until `Tensor` exists, no tensor does either."""
    import sys
    import types

    from kvcluster.storage.base import host_bytes, tensor_type

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # as it is halfway through its import
    assert tensor_type() == ()
    block = np.arange(4096, dtype=np.uint8)
    assert np.array_equal(host_bytes(block), block)
    backend = NVMeBackend(tmp_path, 2, 4096)
    key = BlockKey(b"\x01" * 16)
    assert backend.put_many([(key, block)]) == [True]
    assert np.array_equal(backend.get_many([key])[0], block)
