"""Tensor payloads: every tier takes torch tensors as blocks and memory pools fill tensor `out` buffers.

The device branch (DMA between a device tensor and a pool) needs CUDA and is measured by
`benchmarks/gpu_check.sh`; here CPU tensors go through the same calls and must give the same
bytes and the same digests as numpy payloads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcluster.keys import KeySpace
from kvcluster.storage import NVMeBackend, dram_backend
from kvcluster.storage.base import StorageError, checksum, host_bytes, host_out
from kvcluster.storage.pfs import PFSBackend

BLOCK = 4096


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    """n blocks of bf16 KV-like data, one row per block."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, BLOCK // 2), generator=g).to(torch.bfloat16)


def keys(n: int, tag: str = "t") -> list:
    return KeySpace(model="tensor-payloads").chain_hash_ids(list(range(n)), cache_salt=tag)


def test_checksum_of_a_tensor_is_that_of_its_bytes() -> None:
    t = blocks(1)[0]
    assert checksum(t) == checksum(t.view(torch.uint8).numpy().tobytes())
    assert host_bytes(t).nbytes == BLOCK


def test_dram_pool_takes_tensors_and_fills_tensor_buffers() -> None:
    pool, src, ks = dram_backend(8, BLOCK), blocks(4), keys(4)
    assert pool.put_many([(k, src[i]) for i, k in enumerate(ks)]) == [True] * 4
    out = torch.zeros((4, BLOCK), dtype=torch.uint8)
    got, digests = pool.read_verified(ks, list(out))
    assert all(g is not None for g in got)
    assert torch.equal(out, src.view(torch.uint8))
    assert digests == [checksum(src[i]) for i in range(4)]
    as_numpy = pool.get_many(ks)
    assert all(np.array_equal(a, src[i].view(torch.uint8).numpy()) for i, a in enumerate(as_numpy))


def test_a_tensor_payload_must_be_contiguous() -> None:
    pool = dram_backend(2, BLOCK)
    strided = torch.zeros((BLOCK // 2, 2), dtype=torch.bfloat16).t()  # [2, BLOCK/2] but column-major
    with pytest.raises(ValueError, match="contiguous"):
        pool.put_many([(keys(1)[0], strided[0])])


def test_a_corrupt_slot_read_into_a_tensor_is_a_miss() -> None:
    pool, src, ks = dram_backend(4, BLOCK), blocks(2, seed=1), keys(2, "c")
    pool.put_many([(k, src[i]) for i, k in enumerate(ks)])
    entry = pool.table.get(ks[1])
    pool.pool[entry.slot, 100] ^= 0xFF
    out = torch.zeros((2, BLOCK), dtype=torch.uint8)
    got, digests = pool.read_verified(ks, list(out))
    assert got[0] is not None and got[1] is None and digests[1] is None
    assert pool.contains(ks) == [True, False]  # dropped: the next lookup is a plain miss


@pytest.mark.parametrize("tier", ["nvme", "pfs"])
def test_file_tiers_take_tensors_and_cpu_tensor_buffers(tier: str, tmp_path) -> None:
    backend = NVMeBackend(tmp_path, 4, BLOCK) if tier == "nvme" else PFSBackend(tmp_path, 4 * BLOCK)
    src, ks = blocks(3, seed=2), keys(3, tier)
    assert backend.put_many([(k, src[i]) for i, k in enumerate(ks)]) == [True] * 3
    out = torch.zeros((3, BLOCK), dtype=torch.uint8)
    got = backend.get_many(ks, list(out))
    assert all(g is not None for g in got)
    assert torch.equal(out, src.view(torch.uint8))


def test_host_tiers_refuse_device_buffers_by_name() -> None:
    with pytest.raises(ValueError, match="nvme: reads into host buffers, not meta tensors"):
        host_out([torch.empty(BLOCK, dtype=torch.uint8, device="meta")], "nvme")


@pytest.mark.parametrize("nbytes", [1, 31, 32, 4096, 4099, 1 << 20])
def test_tensor_hashes_equal_the_kernels_digest(nbytes: int) -> None:
    """The digest summed where a tensor lies (on the GPU for a block landed in VRAM) is `hash_bytes`'s, sums that
    overflow 64 bits and blocks at odd offsets included."""
    from kvcluster.storage.copyhash import hash_bytes, tensor_hashes

    data = torch.from_numpy(np.random.default_rng(nbytes).integers(0, 256, nbytes + 3, dtype=np.uint8))
    views = [data[:nbytes], data[3:3 + nbytes], torch.full((nbytes,), 255, dtype=torch.uint8)]
    assert tensor_hashes(views) == [hash_bytes(v.numpy()) for v in views]


def test_rdma_takes_registered_tensors_and_refuses_unregistered_device_buffers() -> None:
    from kvcluster.storage.rdma import NixlPeerPool, RDMABackend

    client = RDMABackend(NixlPeerPool(8, BLOCK), BLOCK, 8, lanes=1)
    try:
        rows = torch.zeros((2, 4, BLOCK), dtype=torch.uint8)
        client.register(rows)
        src, ks = blocks(4, seed=3), keys(4, "rdma")
        rows[0].copy_(src.view(torch.uint8))
        assert client.put_many([(k, rows[0, i]) for i, k in enumerate(ks)]) == [True] * 4  # straight from there
        got, digests = client.read_verified(ks, list(rows[1]))
        assert all(g is not None for g in got) and torch.equal(rows[1], src.view(torch.uint8))
        assert digests == [checksum(src[i]) for i in range(4)]
        assert client.stats()["extra"] == {"direct_writes": 1, "direct_reads": 1}
        with pytest.raises(ValueError, match="rdma: device buffers must lie in memory registered"):
            client.read_verified(ks, [torch.empty(BLOCK, dtype=torch.uint8, device="meta")])
        with pytest.raises(StorageError, match="only contiguous host or CUDA tensors"):
            client.register(torch.empty(BLOCK, dtype=torch.uint8, device="meta"))
    finally:
        client.close()


def test_rdma_reads_a_block_straight_into_its_scattered_pages_and_verifies_them_there() -> None:
    """A block bound for a paged KV cache lands in its pages (one per layer, in layer tensors registered with NIXL)
    in one transfer: the pages hold the row's slices in order; a corrupt block is a miss and is dropped at the
    peer; a block stored with another length is a miss left there; pages outside registered memory are refused."""
    from kvcluster.storage.rdma import NixlPeerPool, RDMABackend

    layers, page = 4, BLOCK // 4
    peer = NixlPeerPool(8, BLOCK)
    client = RDMABackend(peer, BLOCK, 8, lanes=1)
    try:
        paged = [torch.zeros((6, page), dtype=torch.uint8) for _ in range(layers)]  # 6 blocks per layer
        for layer in paged:
            client.register(layer)
        src, ks = blocks(3, seed=5), keys(3, "paged")
        assert client.put_many([(k, src[i]) for i, k in enumerate(ks)]) == [True] * 3
        targets = [5, 0, 2]
        digests = client.read_segments(ks, [[layer[b] for layer in paged] for b in targets])
        assert digests == [checksum(src[i]) for i in range(3)]
        rows = src.view(torch.uint8)
        for i, b in enumerate(targets):
            assert all(torch.equal(paged[j][b], rows[i, j * page:(j + 1) * page]) for j in range(layers))
        assert torch.count_nonzero(torch.stack([layer[[1, 3, 4]] for layer in paged])) == 0  # no other page
        assert client.stats()["extra"]["segmented_reads"] == 1

        peer.pool[peer.table.get(ks[1]).slot, 7] ^= 0x01  # a bit flips in the peer's memory
        assert client.read_segments(ks, [[layer[b] for layer in paged] for b in targets])[1] is None
        assert client.contains(ks) == [True, False, True]  # the corrupt copy was dropped there
        three_layers = [[layer[b] for layer in paged[:3]] for b in targets]  # another layout: not this block
        assert client.read_segments(ks, three_layers) == [None, None, None] and client.contains(ks)[0]
        with pytest.raises(ValueError, match="registered"):
            client.read_segments(ks[:1], [[torch.zeros(page, dtype=torch.uint8) for _ in range(layers)]])
        with pytest.raises(ValueError, match="2 segment lists for 1 blocks"):
            client.read_segments(ks[:1], three_layers[:2])
        assert client.read_segments([], []) == []
    finally:
        client.close()


def test_a_tier_that_reads_into_host_memory_fills_device_buffers_from_its_verified_copies(tmp_path) -> None:
    """A fetch into device rows (the runner's landing on a GPU) through a tier of files: the tier reads and verifies
    on the host, and the store copies into the device rows ("meta" tensors stand in for a device here)."""
    from kvcluster.storage.tiered import TieredStore

    nvme = NVMeBackend(tmp_path, 4, BLOCK)
    store = TieredStore([nvme], BLOCK)
    src, ks = blocks(3, seed=4), keys(3, "fallback")
    store.commit(ks, list(src), None)
    assert store.manager.lookup(ks) == [0, 0, 0]  # all in tier 0
    device_rows = torch.empty((3, BLOCK), dtype=torch.uint8, device="meta")
    got = store.fetch(ks, list(device_rows))
    assert got.hits == 3 and got.tiers == ("nvme",) * 3
    assert all(p.device.type == "meta" and p.nbytes == BLOCK for p in got.payloads)
    host = store.fetch(ks, list(torch.zeros((3, BLOCK), dtype=torch.uint8)))  # host rows: read in place
    assert all(np.array_equal(p, src[i].view(torch.uint8).numpy()) for i, p in enumerate(host.payloads))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device branch needs a CUDA device")
def test_host_and_device_pools_move_cuda_tensors_verified_on_the_device() -> None:
    """On a GPU: device digests equal the kernel's; a host pool takes CUDA payloads (summed there) and fills CUDA
    rows (verified there), a corrupt slot read into a CUDA row is a miss; HBM moves device to device."""
    from kvcluster.storage import hbm_backend
    from kvcluster.storage.copyhash import hash_bytes, tensor_hashes

    src, ks = blocks(4, seed=5).cuda(), keys(4, "cuda")
    host = src.view(torch.uint8).cpu()
    assert tensor_hashes(list(src.view(torch.uint8))) == [hash_bytes(r.numpy()) for r in host]
    for pool in (dram_backend(8, BLOCK), hbm_backend(8, BLOCK)):
        assert pool.put_many([(k, src[i]) for i, k in enumerate(ks)]) == [True] * 4
        rows = torch.zeros((4, BLOCK), dtype=torch.uint8, device="cuda")
        got, _ = pool.read_verified(ks, list(rows))
        assert all(g is not None and g.is_cuda for g in got) and torch.equal(rows, src.view(torch.uint8)), pool.name
    dram = dram_backend(8, BLOCK)
    dram.put_many([(k, src[i]) for i, k in enumerate(ks)])
    dram.pool[dram.table.get(ks[2]).slot, 7] ^= 1
    got, digests = dram.read_verified(ks, list(torch.zeros((4, BLOCK), dtype=torch.uint8, device="cuda")))
    assert [g is None for g in got] == [False, False, True, False] and digests[2] is None
