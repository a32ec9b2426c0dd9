"""The cache manager and its plans: the simulator's hit rates over real bytes, tiers that match the
bookkeeping after every request, failed moves that become misses, pinned blocks that stay put."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.block_types import pair_index
from kvcluster.cache_manager import MIN_KEYS_SWEPT, CacheManager
from kvcluster.control_plane import ControlPlane
from kvcluster.plan_executor import execute
from kvcluster.serving.block_store import LocalBlockStore
from kvcluster.hierarchy import TierPlan
from kvcluster.simulator import prepare, replay, request_context
from kvcluster.storage import NVMeBackend, PFSBackend, dram_backend
from kvcluster.storage.tiered import TieredStore
from kvcluster.traces import load_trace

from data_support import require_data

BLOCK = 64


def key_of(block: int) -> bytes:
    return block.to_bytes(8, "big")


def payload_of(key: bytes) -> np.ndarray:
    return np.frombuffer(key * (BLOCK // len(key)), dtype=np.uint8).copy()


class DictTiers:
    """An in-memory data plane with hard capacities: a write into a full tier is refused, and recorded."""

    def __init__(self, capacities: list[int], unreadable: set[bytes] = frozenset()) -> None:
        self.capacities = capacities
        self.tiers: list[dict[bytes, np.ndarray]] = [{} for _ in capacities]
        self.unreadable = set(unreadable)
        self.refused = 0
        self.calls = 0

    def read(self, keys, out=None):
        self.calls += 1
        return {t: ([None if k in self.unreadable else self.tiers[t].get(k) for k in ks], [None] * len(ks))
                for t, ks in keys.items()}

    def delete(self, keys) -> None:
        self.calls += 1
        for t, ks in keys.items():
            for k in ks:
                self.tiers[t].pop(k, None)

    def write(self, items):
        self.calls += 1
        out = {}
        for t, (ks, ps, _) in items.items():
            ok = []
            for k, p in zip(ks, ps):
                room = len(self.tiers[t]) < self.capacities[t] or k in self.tiers[t]
                if room:
                    self.tiers[t][k] = p
                self.refused += not room
                ok.append(room)
            out[t] = ok
        return out


def assert_tiers_match(manager: CacheManager, tiers: DictTiers) -> None:
    for t, (name, resident) in enumerate(manager.resident().items()):
        assert set(resident) == set(tiers.tiers[t]), f"tier {name}: bookkeeping and bytes disagree"
        for key, data in tiers.tiers[t].items():
            assert np.array_equal(data, payload_of(key)), f"tier {name} holds wrong bytes"


def replay_through_plane(trace, policy: str, plan: list[TierPlan], policy_options: dict | None = None,
                         keys_swept_from: int = MIN_KEYS_SWEPT) -> tuple[list[int], DictTiers, CacheManager]:
    manager = CacheManager(plan, policy, policy_options=policy_options, keys_swept_from=keys_swept_from)
    tiers = DictTiers([t.capacity_blocks for t in plan])
    plane = ControlPlane(manager, tiers)
    hits = [0] * len(plan)
    for i, blocks in enumerate(trace.blocks):
        keys = [key_of(b) for b in blocks]
        got = plane.serve(keys, {k: payload_of(k) for k in keys}, request_context(trace, i))
        for tier, data, key in zip(got.tiers, got.payloads, keys):
            assert np.array_equal(data, payload_of(key))
            hits[tier] += 1
    return hits, tiers, manager


@pytest.fixture(scope="module")
def mooncake_slice():
    return prepare(load_trace(str(require_data("mooncake", "synthetic_trace.jsonl")), max_records=300))


@pytest.mark.parametrize("keys_swept_from", [MIN_KEYS_SWEPT, 64])
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "sieve", "bayes", "bayes-v1"])
def test_the_plane_over_real_bytes_hits_exactly_what_the_simulator_replays(mooncake_slice, policy: str,
                                                                           keys_swept_from: int) -> None:
    # from 64 keys on, the key table lets go of blocks no policy remembers many times over the trace (bayes
    # remembering few ghosts too), and a key let go that comes back is a block never met, in both
    trace = mooncake_slice
    plan = [TierPlan("dram", trace.unique_blocks // 50), TierPlan("nvme", trace.unique_blocks // 25),
            TierPlan("pfs", trace.unique_blocks // 10)]
    swept = keys_swept_from < trace.unique_blocks
    options = {"ghost_factor": 0.5, "min_ghosts": 0} if swept and policy == "bayes" else None
    simulated = replay(trace, policy, plan, policy_options=options)
    hits, tiers, manager = replay_through_plane(trace, policy, plan, options, keys_swept_from)
    if swept and policy != "bayes-v1":  # its predictor watches every block of this short trace
        assert manager.tracked() < trace.unique_blocks // 2
    assert hits == [t["hits"] for t in simulated.tiers]
    assert sum(hits) == simulated.prefix_hits > 0
    assert tiers.refused == 0  # the deletes of a plan always made the room its writes needed
    assert_tiers_match(manager, tiers)
    assert [len(t) for t in tiers.tiers] == [min(p.capacity_blocks, n) for p, n in
                                            zip(plan, manager.occupancy().values())]


def serve_through_local_store(trace, policy: str, tmp_path, answers_at_finish: bool = False) -> int:
    """The trace served as a runner serves requests: `fetch` the prompt's run, then `store` all of the request's
    blocks (None for the fetched run) with their pairs, how the answer ended and the session; or, as vLLM's
    connector does (`answers_at_finish`), stored without the answer and `answered` right after. Returns the
    hits."""
    tiers = [dram_backend(trace.unique_blocks // 50, BLOCK), NVMeBackend(tmp_path / "nvme", trace.unique_blocks // 25,
                                                                          BLOCK),
             PFSBackend(tmp_path / "pfs", trace.unique_blocks // 10 * BLOCK)]
    arrivals = iter(trace.arrivals)
    store = LocalBlockStore(TieredStore(tiers, BLOCK, policy), clock=lambda: next(arrivals))
    hits = 0
    for i, blocks in enumerate(trace.blocks):
        keys = [b.to_bytes(16, "big") for b in blocks]  # real backends take 16-byte digests
        got = store.fetch(keys)
        assert all(np.array_equal(p, payload_of(k)) for p, k in zip(got, keys))
        hits += len(got)
        ctx = request_context(trace, i)
        answer = ("", 0) if answers_at_finish else (ctx.finish, ctx.output_tokens)
        store.store(keys, [None] * len(got) + [payload_of(k) for k in keys[len(got):]],
                    [pair_index(t, ctx.transition) for t in ctx.block_types], *answer, ctx.session)
        if answers_at_finish:
            store.answered(ctx.session, ctx.finish, ctx.output_tokens)
    store.tiered.check_integrity()
    return hits


@pytest.mark.parametrize("policy", ["lru", "bayes"])
def test_a_local_store_serving_the_trace_hits_exactly_what_the_simulator_replays(policy: str, tmp_path) -> None:
    # a request is one use of its blocks, with its context; counted at `fetch` as a request of its own (with
    # no context), this slice's bayes hits 303 blocks, not the replay's 240
    trace = prepare(load_trace(str(require_data("mooncake", "synthetic_trace.jsonl")), max_records=600))
    plan = [TierPlan("dram", trace.unique_blocks // 50), TierPlan("nvme", trace.unique_blocks // 25),
            TierPlan("pfs", trace.unique_blocks // 10)]
    assert serve_through_local_store(trace, policy, tmp_path) == replay(trace, policy, plan).prefix_hits > 0


def test_a_local_store_told_each_answer_after_its_store_hits_what_the_simulator_replays_so(tmp_path) -> None:
    trace = prepare(load_trace(str(require_data("mooncake", "synthetic_trace.jsonl")), max_records=600))
    plan = [TierPlan("dram", trace.unique_blocks // 50), TierPlan("nvme", trace.unique_blocks // 25),
            TierPlan("pfs", trace.unique_blocks // 10)]
    told = replay(trace, "bayes", plan, answers_at_finish=True).prefix_hits
    assert serve_through_local_store(trace, "bayes", tmp_path, answers_at_finish=True) == told > 0
    assert told != replay(trace, "bayes", plan).prefix_hits  # the order the answer comes in matters here


requests = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(requests=requests, caps=st.tuples(st.integers(1, 6), st.integers(0, 6), st.integers(1, 8)),
       policy=st.sampled_from(["lru", "arc", "s3fifo", "sieve", "bayes"]),
       pinned=st.lists(st.integers(0, 40), max_size=4))
def test_after_every_request_each_tier_holds_exactly_what_the_manager_says(requests, caps, policy, pinned) -> None:
    plan = [TierPlan(n, c) for n, c in zip(("dram", "nvme", "pfs"), caps)]
    manager = CacheManager(plan, policy, keys_swept_from=4)  # keys let go as soon as no policy remembers them
    tiers = DictTiers(list(caps))
    plane = ControlPlane(manager, tiers)
    for n, blocks in enumerate(requests):
        keys = [key_of(b) for b in blocks]
        readers = [key_of(b) for b in pinned] if n % 2 else []  # a reader holds some blocks meanwhile
        for k in readers:
            manager.prepare_load([k])
        if n % 3 == 1:  # some of them read from another node first: kept without a use
            plane.place(keys[:2], {k: (payload_of(k), None) for k in keys[:2]})
            assert_tiers_match(manager, tiers)
        plane.serve(keys, {k: payload_of(k) for k in keys})
        manager.complete_load(readers)
        manager.hierarchy.check_integrity()
        assert_tiers_match(manager, tiers)
        assert tiers.refused == 0


def test_a_block_whose_source_cannot_be_read_is_dropped_not_claimed() -> None:
    manager = CacheManager([TierPlan("dram", 2), TierPlan("nvme", 4)], "lru")
    tiers = DictTiers([2, 4])
    plane = ControlPlane(manager, tiers)
    a, b, c = key_of(1), key_of(2), key_of(3)
    plane.serve([a, b], {a: payload_of(a), b: payload_of(b)})
    plane.serve([c], {c: payload_of(c)})  # a falls to nvme
    assert manager.tier_of(a) == 1
    tiers.unreadable.add(a)  # its bytes rot in nvme
    got = plane.serve([a, b], {a: payload_of(a), b: payload_of(b)})
    assert got.tiers == () and got.corrupt == 1  # the run stops at a: nothing served from it
    assert manager.tier_of(a) == 0  # recomputed and stored again from the request's own bytes
    assert_tiers_match(manager, tiers)
    events = [(e.kind, e.key) for e in manager.drain_events()]
    assert ("lost", a) in events and ("stored", a) in events


def test_keys_no_policy_remembers_are_let_go_and_their_ids_reused() -> None:
    manager = CacheManager([TierPlan("dram", 2)], "lru", keys_swept_from=4)
    for n in range(1000):  # a new key per request: LRU remembers only the two it holds
        manager.prepare_store([key_of(n)], [key_of(n)])
        assert manager.tracked() <= 2 * 4 + 1
    assert len(manager._keys) <= 2 * 4 + 1  # ids of keys let go went to new keys
    assert manager.lookup([key_of(998), key_of(999)]) == [0, 0] and manager.lookup([key_of(0)]) == []
    plan = manager.prepare_store([key_of(0)], [key_of(0)])  # back after it was let go: a block never met
    assert [(m.src, m.dst) for m in plan.moves if m.key == key_of(0)] == [(None, 0)]
    assert manager.hierarchy.counters[0].hits == 0


def test_a_failed_write_leaves_the_block_out_of_the_bookkeeping() -> None:
    manager = CacheManager([TierPlan("dram", 2)], "lru")
    tiers = DictTiers([1])  # the bytes hold less than the policy believes
    plane = ControlPlane(manager, tiers)
    a, b = key_of(1), key_of(2)
    plan, failed = plane.commit([a, b], {a: (payload_of(a), None), b: (payload_of(b), None)})
    assert failed == [b] and manager.tier_of(b) is None and manager.tier_of(a) == 0
    assert_tiers_match(manager, tiers)


def test_a_pinned_block_is_not_evicted_while_it_is_read() -> None:
    manager = CacheManager([TierPlan("dram", 2)], "lru")
    tiers = DictTiers([2])
    plane = ControlPlane(manager, tiers)
    a, b, c, d = (key_of(i) for i in range(1, 5))
    plane.serve([a], {a: payload_of(a)})
    plane.serve([b], {b: payload_of(b)})
    assert manager.prepare_load([a]) == [0]  # a reader starts copying a out; a is the LRU victim
    plane.serve([c], {c: payload_of(c)})
    assert manager.tier_of(a) == 0 and manager.tier_of(b) is None  # the policy picked the next victim
    manager.complete_load([a])
    e = key_of(5)
    plane.serve([d, e], {d: payload_of(d), e: payload_of(e)})
    assert manager.tier_of(a) is None and manager.tier_of(c) is None  # unpinned, a can go like any block
    assert_tiers_match(manager, tiers)


def test_a_plan_costs_a_fixed_number_of_batched_calls() -> None:
    manager = CacheManager([TierPlan("dram", 8), TierPlan("nvme", 8), TierPlan("pfs", 64)], "lru")
    tiers = DictTiers([8, 8, 64])
    plane = ControlPlane(manager, tiers)
    for start in range(0, 64, 8):
        keys = [key_of(b) for b in range(start, start + 8)]
        plane.serve(keys, {k: payload_of(k) for k in keys})
    keys = [key_of(b) for b in range(8)]  # all in pfs now: a fetch and promotions, demotions all round
    tiers.calls = 0
    plane.serve(keys, {})
    assert tiers.calls == 4  # the run's read, then the plan's read, delete and write rounds; never per block


def test_a_prefetch_lifts_a_held_prefix_into_tier_0_and_its_victim_falls_one_tier() -> None:
    """Tiers of 2 and 4 blocks, LRU: a request of 2 blocks, then another pushes them to tier 1. Prefetching
    the first request's keys moves both back up (src 1 -> dst 0) and the second request's blocks down; the
    plan carried out over real bytes leaves the tiers exactly as the bookkeeping says, with no use counted."""
    manager = CacheManager([TierPlan("dram", 2), TierPlan("nvme", 4)], "lru")
    plane = ControlPlane(manager, tiers := DictTiers([2, 4]))
    first, second = [key_of(1), key_of(2)], [key_of(3), key_of(4)]
    for keys in (first, second):
        plane.commit(keys, {k: (payload_of(k), None) for k in keys})
    assert manager.lookup(first) == [1, 1] and manager.lookup(second) == [0, 0]
    hits_before = [c["hits"] for c in manager.counters()]
    plan = manager.prepare_prefetch(first + [key_of(9)])  # a key held nowhere ends the run
    assert sorted((m.key, m.src, m.dst) for m in plan.moves) == sorted(
        [(key_of(1), 1, 0), (key_of(2), 1, 0), (key_of(3), 0, 1), (key_of(4), 0, 1)])
    manager.complete_store(plan, execute(plan, tiers, {}))
    assert manager.lookup(first) == [0, 0] and manager.lookup(second) == [1, 1]
    assert {t: sorted(d) for t, d in enumerate(tiers.tiers)} == {0: sorted(first), 1: sorted(second)}
    assert all(np.array_equal(tiers.tiers[0][k], payload_of(k)) for k in first)
    assert [c["hits"] for c in manager.counters()] == hits_before and tiers.refused == 0
    assert manager.prepare_prefetch(first).moves == ()  # already in tier 0: nothing moves
    assert manager.prefetch_stats() == {"issued": 2, "hits": 0, "wasted": 0}
    plane.commit(first, {})
    assert manager.prefetch_stats() == {"issued": 2, "hits": 2, "wasted": 0}
