"""The plain classes a tier actor delegates to, without Ray running: prefetch tracking, index reports,
metrics arithmetic, and the NIXL pull (an in-process source pool, no actor in between)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ray")

from kvcluster.actors import metrics, tier_metrics  # noqa: E402
from kvcluster.actors.index_reporter import LISTING_BATCH, IndexReporter  # noqa: E402
from kvcluster.actors.nixl_pull import NixlPuller  # noqa: E402
from kvcluster.actors.prefetch import PrefetchTracker  # noqa: E402
from kvcluster.keys import BlockKey, KeySpace  # noqa: E402
from kvcluster.storage import NixlPeerPool, RDMABackend, StorageError, dram_backend  # noqa: E402

BLOCK = 1 << 14
KEYS = [bytes(k) for k in KeySpace(model="tier-roles").chain_hash_ids(list(range(6)))]
DATA = [np.random.default_rng(i).integers(0, 255, BLOCK, dtype=np.uint8) for i in range(6)]


def test_a_prefetch_is_settled_once_as_hit_or_wasted() -> None:
    tracker = PrefetchTracker()
    assert tracker.read(KEYS) == 0 and tracker.dropped(KEYS) == 0  # nothing promoted: nothing to settle
    tracker.promoted(KEYS[:3])
    assert tracker.read([KEYS[0], KEYS[4]]) == 1  # KEYS[4] was not a prefetch
    assert tracker.dropped([KEYS[1], KEYS[0]]) == 1  # KEYS[0] was already settled as a hit
    assert len(tracker) == 1
    assert tracker.read(iter(KEYS)) == 1 and len(tracker) == 0


class FakeIndex:
    """Records the calls an IndexReporter makes, in order."""

    def __init__(self) -> None:
        self.calls: list = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, *args))


def test_index_reports_are_batched_and_an_empty_batch_sends_nothing() -> None:
    index = FakeIndex()
    reporter = IndexReporter(index, "n0", "pfs")
    reporter.stored([])
    reporter.removed([])
    assert index.calls == []
    reporter.stored(KEYS[:2], [4, 5])
    reporter.removed(KEYS[:1])
    reporter.lost()
    assert index.calls == [("stored", "n0", "pfs", KEYS[:2], [4, 5]), ("removed", "n0", "pfs", KEYS[:1]),
                           ("lost", "n0", "pfs")]
    index.calls.clear()
    held = [i.to_bytes(16, "little") for i in range(LISTING_BATCH + 3)]
    reporter.listed(held)
    assert [(name, len(keys), pairs) for name, _, _, keys, pairs in index.calls] == [
        ("stored", LISTING_BATCH, None), ("stored", 3, None)]


class FakeCounter:
    def __init__(self) -> None:
        self.counts: dict = {}

    def inc(self, value, tags) -> None:
        assert value > 0  # Ray's counters refuse anything else
        key = tuple(sorted(tags.items()))
        self.counts[key] = self.counts.get(key, 0) + value


def test_a_read_is_split_into_hits_misses_and_corrupt_blocks(monkeypatch) -> None:
    lookups, faults = FakeCounter(), FakeCounter()
    monkeypatch.setattr(metrics, "tier_lookups", lambda: lookups)
    monkeypatch.setattr(metrics, "faults", lambda: faults)
    tm = tier_metrics.TierMetrics("n0", "dram")
    tm.reads(asked=5, missing=2, corrupt=1)
    tm.reads(asked=2, missing=0, corrupt=0)
    tm.fault("put_refused", 0)
    def outcome(name: str) -> tuple:
        return ("node", "n0"), ("outcome", name), ("tier", "dram")

    assert lookups.counts == {outcome("hit"): 5, outcome("miss"): 1, outcome("corrupt"): 1}
    assert faults.counts == {(("component", "n0/dram"), ("kind", "corrupt")): 1}


@pytest.fixture(scope="module")
def source() -> NixlPeerPool:
    """Another node's lent pool holding the six blocks."""
    pool = NixlPeerPool(8, BLOCK, name="roles-source")
    assert pool.put_local(KEYS, DATA) == [True] * 6
    return pool


def connect_to(pool: NixlPeerPool, connects: list):
    def connect(source: str, staging_bytes: int, name: str) -> RDMABackend:
        connects.append(source)
        if source != "roles-source":
            raise ValueError(f"no actor named {source}")
        return RDMABackend(pool, staging_bytes, 1, name=name, lanes=1)

    return connect


def test_a_memory_tier_lands_pulled_blocks_in_its_own_slots(source) -> None:
    tier = dram_backend(4, BLOCK)
    lent = NixlPeerPool(4, BLOCK, name="roles-landing", pool=tier.pool, table=tier.table)
    connects: list = []
    puller = NixlPuller("roles-pull", store=None, lend=lambda: lent, connect=connect_to(source, connects))
    assert puller.pull("roles-source", KEYS[:3] + [b"\x07" * 16], 1 << 16) == [True, True, True, None]
    assert puller.pulled == 3 and puller.direct_reads() == 1  # straight into the tier's slab, no staging copy
    got = tier.get_many([BlockKey(k) for k in KEYS[:3]])
    assert all(np.array_equal(g, d) for g, d in zip(got, DATA))
    # KEYS[2] is here already; one slot is left for KEYS[3:6]: the first takes it, the others are refused
    assert puller.pull("roles-source", KEYS[2:6], 1 << 16) == [True, True, False, False]
    assert puller.pulled == 4 and connects == ["roles-source"]  # one client per source, reused
    assert len(tier.table) == 4 and lent.pending == 0  # no reservation left behind
    tier.check_integrity()
    assert puller.pull("gone", KEYS[:1], 1 << 16) == [None]  # a source that is gone: nothing moved


def test_a_staged_pull_stores_what_arrived_with_the_digests_it_was_verified_against(source) -> None:
    stored: list = []

    def store(keys, payloads, digests) -> list[bool]:
        stored.append((keys, [bytes(p) for p in payloads], digests))
        return [True, False][: len(keys)]

    connects: list = []
    puller = NixlPuller("roles-staged", store=store, connect=connect_to(source, connects))
    assert puller.pull("roles-source", [b"\x07" * 16] + KEYS[:2], 1 << 16) == [None, True, False]
    keys, payloads, digests = stored[0]
    assert keys == KEYS[:2] and payloads == [bytes(d) for d in DATA[:2]]
    assert digests == [entry[2] for entry in source.lookup(KEYS[:2])]
    assert puller.pulled == 1 and puller.direct_reads() == 0


def test_a_source_that_fails_is_connected_again_on_the_next_pull(source) -> None:
    connects: list = []
    fail = [True]

    def connect(name_source: str, staging_bytes: int, name: str) -> RDMABackend:
        connects.append(name_source)
        if fail[0]:
            raise StorageError("rdma: NIXL is not importable")
        return RDMABackend(source, staging_bytes, 1, name=name, lanes=1)

    puller = NixlPuller("roles-retry", store=lambda k, p, d: [True] * len(k), connect=connect)
    assert puller.pull("roles-source", KEYS[:2], 1 << 16) == [None, None]
    fail[0] = False
    assert puller.pull("roles-source", KEYS[:2], 1 << 16) == [True, True]
    assert connects == ["roles-source", "roles-source"] and puller.pulled == 2
