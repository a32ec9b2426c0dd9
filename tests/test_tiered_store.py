"""The hierarchy bound to real backends: bytes follow every decision; corruption is a miss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.keys import KeySpace
from kvcluster.policies.base import RequestContext
from kvcluster.storage import NVMeBackend, PFSBackend, dram_backend
from kvcluster.storage.tiered import TieredStore

BLOCK = 4096
SPACE = KeySpace(model="tiered-test")


def kv_of(key: bytes) -> np.ndarray:
    """Deterministic fake KV for a key, so any read can be checked against the truth."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 255, BLOCK, dtype=np.uint8)


def make_store(tmp: Path, policy: str = "lru") -> TieredStore:
    return TieredStore([dram_backend(3, BLOCK), NVMeBackend(tmp / "nvme", 4, BLOCK), PFSBackend(tmp / "pfs", 6 * BLOCK)],
                       BLOCK, policy)


def serve(store: TieredStore, ids: list[int], i: int) -> int:
    keys = SPACE.chain_hash_ids(ids)
    got = store.fetch(keys)
    for key, data in zip(keys, got.payloads):
        assert np.array_equal(data, kv_of(key)), "a fetched payload differs from the KV it stands for"
    new = [None] * got.hits + [kv_of(k) for k in keys[got.hits:]]
    store.commit(keys, new, RequestContext(i, float(i)))
    store.check_integrity()
    return got.hits


def test_blocks_flow_down_and_come_back(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    assert serve(store, [1, 2, 3], 0) == 0
    assert serve(store, [7, 8, 9], 1) == 0  # pushes 1, 2, 3 into nvme
    assert store.manager.tier_of(SPACE.chain_hash_ids([1])[0]) == 1
    assert serve(store, [1, 2, 3, 4], 2) == 3  # read back from nvme, exact bytes
    assert store.fetch(SPACE.chain_hash_ids([1, 2, 3, 4])).tiers == ("nvme", "dram", "dram", "dram")  # LRU pushed 1 down


def test_corrupt_block_in_a_lower_tier_is_a_miss(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    serve(store, [1, 2, 3], 0)
    serve(store, [7, 8, 9], 1)
    nvme = store.backends[1]
    key2 = SPACE.chain_hash_ids([1, 2])[1]
    slot = nvme.table.get(key2).slot
    with open(nvme.path, "r+b") as f:
        f.seek(slot * nvme.slot_bytes + 10)
        f.write(b"\x00\x01\x02")
    result = store.fetch(SPACE.chain_hash_ids([1, 2, 3]))
    assert result.hits == 1 and result.dropped_corrupt == 1  # block 2 is recomputed, never served wrong


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["lru", "bayes", "s3fifo"]),
       st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=5), min_size=1, max_size=25))
def test_every_fetch_returns_true_bytes(tmp_path_factory, policy, requests) -> None:
    store = make_store(tmp_path_factory.mktemp("t"), policy)
    for i, ids in enumerate(requests):
        serve(store, ids, i)


def test_blocks_read_elsewhere_are_placed_in_the_first_tier_without_counting_a_use(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    first = SPACE.chain_hash_ids([1, 2, 3])
    serve(store, [1, 2, 3], 0)  # dram holds the three
    hits = [c["hits"] for c in store.manager.counters()]
    other = SPACE.chain_hash_ids([7, 8])
    store.place(other, [kv_of(k) for k in other], RequestContext(1, 1.0))
    assert [store.manager.tier_of(k) for k in other] == [0, 0]
    assert [store.manager.tier_of(k) for k in first] == [1, 1, 0]  # LRU's victims fell to nvme, bytes and all
    assert [c["hits"] for c in store.manager.counters()] == hits
    store.check_integrity()
    store.place(first, [kv_of(k) for k in first], RequestContext(2, 2.0))  # held already: nothing moves
    assert [store.manager.tier_of(k) for k in first] == [1, 1, 0]
    got = store.fetch(other)
    assert got.tiers == ("dram", "dram") and all(np.array_equal(p, kv_of(k)) for p, k in zip(got.payloads, other))


def test_a_checkpoint_keeps_the_volatile_tiers_blocks_in_pfs_for_a_fresh_store(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    serve(store, [1, 2, 3], 0)
    serve(store, [7, 8, 9], 1)  # 1, 2, 3 in nvme, 7, 8, 9 in dram, pfs empty
    assert store.backends[2].keys() == []
    assert store.checkpoint(batch=2) == 6
    fresh = TieredStore([dram_backend(3, BLOCK), PFSBackend(tmp_path / "pfs", 6 * BLOCK)], BLOCK)
    fresh.manager.adopt(1, fresh.backends[1].keys())
    for ids in ([1, 2, 3], [7, 8, 9]):
        keys = SPACE.chain_hash_ids(ids)
        got = fresh.fetch(keys)
        assert got.tiers == ("pfs",) * 3
        assert all(np.array_equal(p, kv_of(k)) for p, k in zip(got.payloads, keys))


def test_a_checkpoint_stops_where_the_pfs_tier_is_full(tmp_path: Path) -> None:
    store = TieredStore([dram_backend(3, BLOCK), PFSBackend(tmp_path / "pfs", 2 * BLOCK)], BLOCK)
    serve(store, [1, 2, 3], 0)  # three blocks in dram, room for two in pfs
    assert store.checkpoint() == 2
    assert len(store.backends[1].keys()) == 2
