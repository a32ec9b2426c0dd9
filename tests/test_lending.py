"""An engine's paged KV lent as its node's hbm tier: another node reads blocks straight from the engine's pages.

The engine side is `PagedKV` tensors registered with a `NixlRegionLender` and followed by `LentBlocks`; the
directory (`LentDirectory`, the lent-pages actor's state) serves the peer protocol; the reader is the same
`RDMABackend` that reads pools, here with the directory as its control channel, in one process (NIXL over
UCX shared memory). The vLLM cluster test runs it across Ray nodes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.integrations.vllm.lending import LentBlocks, page_digest, page_digests
from kvcluster.integrations.vllm.paged_kv import PagedKV
from kvcluster.keys import KeySpace
from kvcluster.storage import LentDirectory, NixlRegionLender, RDMABackend, StorageError
from kvcluster.storage.base import checksum
from kvcluster.storage.rdma import _paired, _planes

LAYERS, BLOCKS, PAGE = 3, 6, 4096


def engine_kv(seed: int) -> PagedKV:
    """A paged KV like vLLM's on CPU: per layer [blocks, 2, tokens, heads x dim] float32, random."""
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randn((BLOCKS, 2, 8, PAGE // 64), generator=g) for _ in range(LAYERS)]
    return PagedKV(layers, [f"l{i}" for i in range(LAYERS)], BLOCKS, PAGE)


def keys(n: int, tag: str) -> list:
    return KeySpace(model="lending").chain_hash_ids(list(range(n)), cache_salt=tag)


def row(kv: PagedKV, block: int) -> torch.Tensor:
    return torch.cat(kv.block_pages(block))


@pytest.fixture
def lent():
    """An engine whose blocks 4, 1, 2 hold keys 0, 1, 2, lent; a reader on the directory."""
    kv = engine_kv(seed=1)
    lender = NixlRegionLender(kv.regions)
    directory = LentDirectory(lender.metadata, lender.descs, kv.row_bytes, lender.name)
    blocks, ks = LentBlocks(), keys(3, "lent")
    for key, b in zip(ks, [4, 1, 2]):
        blocks.lend(key, b, kv.row_bytes, page_digest(kv.block_pages(b)))
    came, gone = directory.update(*blocks.drain())
    assert (len(came), gone) == (3, [])
    reader = RDMABackend(directory, 2 * kv.row_bytes, BLOCKS, lanes=1)
    try:
        yield kv, blocks, directory, reader, ks
    finally:
        reader.close()
        lender.close()


def test_a_lent_block_is_read_from_the_engines_pages_staged_or_into_the_readers_pages(lent) -> None:
    kv, _, _, reader, ks = lent
    got, digests = reader.read_verified(ks)  # through the staging buffer (2 blocks of it: two parts)
    assert all(torch.equal(torch.from_numpy(g), row(kv, b)) for g, b in zip(got, [4, 1, 2]))
    assert digests == [checksum(row(kv, b).numpy()) for b in [4, 1, 2]]

    mine = engine_kv(seed=2)  # the reader's own engine: its pages registered, blocks land there page for page
    for region in mine.regions:
        reader.register(region)
    targets = [0, 5, 3]
    assert reader.read_segments(ks, [mine.block_pages(b) for b in targets]) == digests
    assert all(torch.equal(row(mine, t), row(kv, b)) for t, b in zip(targets, [4, 1, 2]))
    assert reader.put_many([(ks[0], row(kv, 4))]) == [False]  # lent memory takes no writes


def test_pages_rewritten_before_the_directory_knows_are_a_miss_and_leave_it(lent) -> None:
    """The directory trails the engine by a step: a reader may read pages vLLM has just rewritten. Their digest
    no longer matches: a miss, and the key is dropped from the directory; the engine's next report agrees."""
    kv, blocks, directory, reader, ks = lent
    blocks.written([1])  # the engine's next forward writes block 1 ...
    kv.block_pages(1)[2][100] ^= 0xFF  # ... and does, before its report reaches the directory
    got, _ = reader.read_verified(ks)
    assert got[0] is not None and got[1] is None and got[2] is not None
    assert directory.lookup([bytes(ks[1])]) == [None] and reader.stats()["corrupt"] == 1
    entered, left = blocks.drain()
    assert (entered, left) == ([], [bytes(ks[1])])
    assert directory.update(entered, left) == ([], [])  # gone already: nothing more for the index


def test_regions_that_do_not_hold_whole_blocks_are_refused() -> None:
    kv = engine_kv(seed=3)
    lender = NixlRegionLender(kv.regions)
    try:
        with pytest.raises(StorageError, match="do not hold whole"):
            RDMABackend(LentDirectory(lender.metadata, lender.descs, kv.row_bytes + 1, lender.name), 1 << 20, 1)
    finally:
        lender.close()
    with pytest.raises(StorageError, match="contiguous tensors, at least one"):
        NixlRegionLender([])


class _Descs:
    """NIXL's deserialized descriptor list, as `_planes` reads it."""

    def __init__(self, regions):
        self.regions = regions

    def descCount(self):  # noqa: N802 - NIXL's name
        return len(self.regions)

    def __getitem__(self, i):
        return self.regions[i]

    def getType(self):  # noqa: N802
        return "DRAM_SEG"


def test_a_pool_is_one_plane_and_a_paged_kv_a_plane_per_layer() -> None:
    planes, mem = _planes(_Descs([(1 << 20, 8 * 4096, 0)]), 4096)
    assert [(p.base, p.stride) for p in planes] == [(1 << 20, 4096)] and mem == ("DRAM", 0)
    planes, _ = _planes(_Descs([(1 << 20, 6 * 1024, 0), (2 << 20, 6 * 1024, 0), (3 << 20, 6 * 2048, 0)]), 4096)
    assert [(p.base, p.stride) for p in planes] == [(1 << 20, 1024), (2 << 20, 1024), (3 << 20, 2048)]


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.lists(st.integers(1, 50), min_size=1, max_size=8))
def test_paired_pieces_move_local_segments_to_peer_segments_byte_for_byte(local_sizes, peer_sizes) -> None:
    total = sum(local_sizes)
    peer_sizes = peer_sizes[:-1] + [max(0, total - sum(peer_sizes[:-1]))] if total >= sum(peer_sizes[:-1]) else [total]
    local = [(1000 * (i + 1), n) for i, n in enumerate(local_sizes)]
    peer = [(10 ** 6 * (j + 1), n) for j, n in enumerate(peer_sizes)]
    pieces = _paired(local, peer)

    def byte_addresses(segments):
        return [a + k for a, n in segments for k in range(n)]

    assert all(n > 0 for *_, n in pieces)
    assert [a + k for a, _, n in pieces for k in range(n)] == byte_addresses(local)
    assert [p + k for _, p, n in pieces for k in range(n)] == byte_addresses(peer)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(["lend", "written", "drain"]), st.integers(0, 5), st.integers(0, 7)),
                max_size=40))
def test_the_directory_follows_the_engines_lent_blocks_through_any_steps(ops) -> None:
    """Whatever the engine lends and rewrites, once its changes are drained into the directory, the directory
    finds each key at the block the engine lends it from and nowhere else; a block lends one key at a time."""
    blocks, directory = LentBlocks(), LentDirectory(b"", b"", 64, "engine")
    ks = [bytes(k) for k in keys(8, "ops")]
    for op, block, k in ops:
        if op == "lend":
            blocks.lend(ks[k], block, 64, digest=block * 100 + k)
        elif op == "written":
            blocks.written([block])
        else:
            directory.update(*blocks.drain())
    directory.update(*blocks.drain())
    for k in ks:
        b = blocks.block_of(k)
        assert directory.lookup([k]) == [None if b is None else (b, 64, b * 100 + ks.index(k))]
    lent = [blocks.block_of(k) for k in ks if blocks.block_of(k) is not None]
    assert len(lent) == len(set(lent)) == len(blocks) == len(directory)


def test_the_digests_of_a_batch_of_blocks_are_each_blocks_own() -> None:
    kv = engine_kv(seed=4)
    assert page_digests([kv.block_pages(b) for b in (3, 0, 3)]) == [checksum(row(kv, b).numpy()) for b in (3, 0, 3)]
    assert page_digests([]) == []


def test_a_report_with_a_block_longer_than_a_slot_is_refused_whole() -> None:
    directory = LentDirectory(b"", b"", 64, "engine")
    ks = [bytes(k) for k in keys(2, "long")]
    directory.update([(ks[0], 1, 64, 7)], [])
    with pytest.raises(ValueError, match="lent blocks of \\[65\\] bytes in slots of 64"):
        directory.update([(ks[1], 2, 65, 8)], [ks[0]])
    assert directory.lookup(ks) == [(1, 64, 7), None]  # nothing of the refused report was applied
