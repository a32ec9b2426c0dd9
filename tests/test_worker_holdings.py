"""What vLLM's scheduler knows of workers in other processes: their stores' residency reports, mirrored.

The invariant: after every report, the mirror says a block is held exactly when every worker's store holds
it, so the scheduler promises nothing a worker lacks (beyond the one step a report lags).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.integrations.vllm.holdings import RankReport, WorkerHoldings
from kvcluster.keys import stand_in_key
from kvcluster.serving.block_store import LocalBlockStore
from kvcluster.storage import PFSBackend, dram_backend
from kvcluster.storage.tiered import TieredStore

BLOCK_BYTES = 256


def payload(key: bytes) -> np.ndarray:
    return np.frombuffer((key * (BLOCK_BYTES // len(key) + 1))[:BLOCK_BYTES], dtype=np.uint8).copy()


def worker_store(blocks: int) -> LocalBlockStore:
    return LocalBlockStore(TieredStore([dram_backend(blocks, BLOCK_BYTES)], BLOCK_BYTES, "lru"))


def held_keys(store: LocalBlockStore) -> set[bytes]:
    return {k for keys in store.tiered.manager.resident().values() for k in keys}


def test_a_store_reports_what_entered_and_left_its_tiers() -> None:
    store = worker_store(2)
    a, b, c = (stand_in_key(i) for i in range(3))
    assert store.residency_changes() == ([], [], True)  # first: the full listing (empty)
    store.store([a, b], [payload(a), payload(b)])
    assert store.residency_changes() == ([a, b], [], False)
    store.store([c], [payload(c)])  # LRU: a falls out of the only tier
    assert store.residency_changes() == ([c], [a], False)
    assert store.residency_changes() == ([], [], False)


def test_a_corrupt_block_leaves_the_report_as_it_leaves_the_tiers(tmp_path) -> None:
    tiered = TieredStore([PFSBackend(tmp_path, 4 * BLOCK_BYTES)], BLOCK_BYTES, "lru")
    store = LocalBlockStore(tiered)
    a, b = stand_in_key(1), stand_in_key(2)
    store.store([a, b], [payload(a), payload(b)])
    assert store.residency_changes() == ([a, b], [], True)
    path = tiered.backends[0].path_for(b)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert len(store.fetch([a, b])) == 1  # b fails its checksum: a miss, and gone
    assert store.residency_changes() == ([], [b], False)


def test_the_first_report_lists_the_blocks_adopted_from_files(tmp_path) -> None:
    keys = [stand_in_key(i) for i in range(3)]
    first = LocalBlockStore(TieredStore([PFSBackend(tmp_path, 4 * BLOCK_BYTES)], BLOCK_BYTES, "lru"))
    first.store(keys, [payload(k) for k in keys])
    fresh = TieredStore([PFSBackend(tmp_path, 4 * BLOCK_BYTES)], BLOCK_BYTES, "lru")
    fresh.manager.adopt(0, fresh.backends[0].keys())
    entered, left, full = LocalBlockStore(fresh).residency_changes()
    assert (sorted(entered), left, full) == (sorted(keys), [], True)


def test_a_block_is_held_only_when_every_worker_holds_it() -> None:
    a, b, c = (stand_in_key(i) for i in range(3))
    holdings = WorkerHoldings(2)
    holdings.apply(0, RankReport([a, b, c], [], full=True))
    assert holdings.held([a, b, c]) == 0  # worker 1 has not reported
    holdings.apply(1, RankReport([a, c], [], full=True))
    assert holdings.held([a, b, c]) == 1  # b is only on worker 0: the run stops there
    holdings.apply(1, RankReport([b], [a]))
    assert holdings.held([a, b, c]) == 0 and holdings.held([b, c]) == 2
    assert len(holdings) == 3


def test_a_full_report_replaces_what_was_seeded_for_that_worker() -> None:
    a, b = stand_in_key(1), stand_in_key(2)
    holdings = WorkerHoldings(2)
    for rank in (0, 1):
        holdings.seed(rank, [a, b])
    assert holdings.held([a, b]) == 2  # promised from the files before the workers report
    holdings.apply(1, RankReport([a], [], full=True))  # worker 1 adopted only a (capacity)
    assert holdings.held([a, b]) == 1
    with pytest.raises(ValueError, match="rank 2"):
        holdings.apply(2, RankReport())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 11), min_size=1, max_size=5)),
                min_size=1, max_size=40))
def test_the_mirror_equals_the_intersection_of_the_workers_stores(requests) -> None:
    """Three workers of different capacities serve requests; after each step's reports the mirror's
    `held` is the leading run every worker's store holds."""
    workers = [worker_store(n) for n in (3, 5, 8)]
    holdings = WorkerHoldings(len(workers))
    for rank, store in enumerate(workers):
        entered, left, full = store.residency_changes()
        holdings.apply(rank, RankReport(entered, left, full))
    for rank, ids in requests:
        keys = [stand_in_key(i) for i in dict.fromkeys(ids)]
        store = workers[rank]
        got = store.fetch(keys)
        store.store(keys, [None] * len(got) + [payload(k) for k in keys[len(got):]])
        for r, s in enumerate(workers):
            entered, left, full = s.residency_changes()
            holdings.apply(r, RankReport(entered, left, full))
        everywhere = set.intersection(*(held_keys(s) for s in workers))
        probe = [stand_in_key(i) for i in range(12)]
        expected = next((n for n, k in enumerate(probe) if k not in everywhere), len(probe))
        assert holdings.held(probe) == expected
