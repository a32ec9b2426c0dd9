"""Tier, index and predictor actors on a real local Ray instance."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from kvcluster.actors.deploy import start_global_actors, start_tier_actor  # noqa: E402
from kvcluster.actors.tier_actor import TierActorConfig  # noqa: E402
from kvcluster.keys import KeySpace  # noqa: E402
from kvcluster.policies.base import RequestContext  # noqa: E402

KEYS = [bytes(k) for k in KeySpace(model="actors").chain_hash_ids(list(range(6)))]


@pytest.fixture(scope="session")
def ray_session():
    tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
             namespace="kvcluster", _temp_dir=tmp, log_to_driver=False)
    yield tmp
    ray.shutdown()


@pytest.fixture(scope="session")
def cluster_actors(ray_session):
    index, predictor = start_global_actors(checkpoint_dir=os.path.join(ray_session, "pfs", "predictor"))
    node_id = ray.get_runtime_context().get_node_id()
    dram = start_tier_actor(TierActorConfig.of(node="n0", kind="dram", slots=8, slot_bytes=4096), node_id)
    pfs = start_tier_actor(TierActorConfig.of(node="n0", kind="pfs", slots=64, slot_bytes=4096,
                                           path=os.path.join(ray_session, "pfs")), node_id)
    return index, predictor, dram, pfs


def wait_for(fn, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not reached")


def payload(i: int) -> np.ndarray:
    return np.full(4096, i, dtype=np.uint8)


def test_blocks_written_through_a_tier_actor_are_indexed(cluster_actors) -> None:
    index, _, dram, pfs = cluster_actors
    assert ray.get(dram.put_many.remote(KEYS[:3], [payload(i) for i in range(3)])) == [True] * 3
    assert ray.get(pfs.put_many.remote(KEYS[:5], [payload(i) for i in range(5)])) == [True] * 5
    match = wait_for(lambda: (m := ray.get(index.longest_prefix.remote(KEYS))).length == 5 and m)
    assert match.locations[0][0] == ("n0", "dram") and match.best_node() == "n0"
    got = ray.get(dram.get_many.remote(KEYS[:3]))
    assert all(np.array_equal(g, payload(i)) for i, g in enumerate(got))


def test_killed_tier_actor_restarts_and_loses_only_its_blocks(cluster_actors) -> None:
    index, _, dram, pfs = cluster_actors
    ray.get(dram.put_many.remote(KEYS[:2], [payload(9), payload(8)]))
    ray.kill(dram, no_restart=False)
    def restarted_empty():
        got = _try(lambda: ray.get(dram.get_many.remote(KEYS[:2]), timeout=5))
        return isinstance(got, list) and all(g is None for g in got)

    wait_for(restarted_empty)  # the restarted actor answers with misses, not errors
    occupancy = wait_for(lambda: (o := ray.get(index.occupancy.remote())) and "dram" not in o.get("n0", {}) and o)
    assert occupancy["n0"]["pfs"] == 5
    assert np.array_equal(ray.get(pfs.get_many.remote(KEYS[:1]))[0], payload(0))


def test_predictor_survives_a_restart(cluster_actors) -> None:
    _, predictor, _, _ = cluster_actors
    for t in range(3):
        ray.get(predictor.observe.remote(KEYS[:2], [4, 4], float(t)))
    before = ray.get(predictor.snapshot.remote())
    assert before.alpha[4] == 1.0 + 4  # two blocks reused twice
    ray.get(predictor.checkpoint.remote())
    ray.kill(predictor, no_restart=False)
    after = wait_for(lambda: _try(lambda: ray.get(predictor.snapshot.remote(), timeout=5)))
    assert after.alpha == before.alpha and after.version == before.version


def _try(fn):
    try:
        return fn() or True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
        return None


def test_a_move_between_tiers_drops_the_source_only_for_verified_copies(cluster_actors) -> None:
    """The control plane's mover within a node: `read_verified` at the source, `put_many` with those digests at
    the destination, `delete` at the source only for what the destination acknowledged. A payload changed on
    the way is refused there, so that block stays at its source: never in zero places, never wrong bytes."""
    index, _, dram, pfs = cluster_actors
    keys = [bytes(k) for k in KeySpace(model="move").chain_hash_ids(list(range(8)))]
    assert ray.get(dram.put_many.remote(keys, [payload(40 + i) for i in range(8)])) == [True] * 8
    payloads, digests = ray.get(dram.read_verified.remote(keys[:4]))
    assert all(d is not None for d in digests)
    payloads[0] = payloads[0].copy()
    payloads[0][7] ^= 1  # changed after it was verified
    acked = ray.get(pfs.put_many.remote(keys[:4], payloads, None, False, digests))
    assert acked == [False, True, True, True]
    assert ray.get(dram.delete.remote([k for k, ok in zip(keys[:4], acked) if ok])) == 3
    match = wait_for(lambda: (m := ray.get(index.longest_prefix.remote(keys))).length == 8
                     and sum(locs == (("n0", "pfs"),) for locs in m.locations) == 3 and m)
    assert [locs == (("n0", "pfs"),) for locs in match.locations] == [False, True, True, True] + [False] * 4
    in_dram = ray.get(dram.get_many.remote(keys))
    in_pfs = ray.get(pfs.get_many.remote(keys[1:4]))
    got = [in_dram[0], *in_pfs, *in_dram[4:]]
    assert all(np.array_equal(g, payload(40 + i)) for i, g in enumerate(got))  # every block, exact, somewhere
    assert ray.get(dram.delete.remote(keys)) == 5 and ray.get(pfs.delete.remote(keys)) == 3


def test_prefetched_blocks_are_counted_as_hit_or_wasted(cluster_actors) -> None:
    """Blocks put with prefetch=True (promoted ahead of use) are tracked until read (hit) or deleted unread
    (wasted). No live component issues such puts at present; only tests do."""
    _, _, dram, _ = cluster_actors
    keys = [bytes(k) for k in KeySpace(model="prefetch").chain_hash_ids(list(range(3)))]
    assert ray.get(dram.put_many.remote(keys, [np.zeros(4096, np.uint8)] * 3, None, True)) == [True] * 3
    assert ray.get(dram.stats.remote())["prefetched_unread"] == 3
    ray.get(dram.get_many.remote(keys[:1]))
    ray.get(dram.delete.remote(keys[1:2]))
    assert ray.get(dram.stats.remote())["prefetched_unread"] == 1
    ray.get(dram.delete.remote(keys))


def test_a_replica_reads_dram_over_nixl_and_a_restarted_tier_is_a_miss_then_refills(cluster_actors) -> None:
    """The replica's store reads the node's dram slab over NIXL (one lookup, one transfer, checksums here); when
    the tier actor restarts, its old NIXL agent is gone: that fetch is a miss, never an error or wrong bytes."""
    from kvcluster.serving.block_store import LocalBlockStore
    from kvcluster.storage import hbm_backend
    from kvcluster.storage.tiered import TieredStore
    from kvcluster.serve_apps.cluster_store import ClusterBlockStore

    index, _, dram, _ = cluster_actors
    block_keys = KeySpace(model="nixl-replica").chain_hash_ids(list(range(4)))
    keys = [bytes(k) for k in block_keys]
    data = [np.random.default_rng(40 + i).integers(0, 255, 4096, dtype=np.uint8) for i in range(4)]
    readers: dict = {}  # one NIXL reader per tier across fetches, as in a replica

    def fetch() -> tuple[list, ClusterBlockStore]:
        store = ClusterBlockStore(LocalBlockStore(TieredStore([hbm_backend(8, 4096)], 4096)), "n0",
                                  nixl_staging_bytes=1 << 16)
        store._readers = readers
        return store.fetch(block_keys), store

    assert all(ray.get(dram.put_many.remote(keys, data)))
    wait_for(lambda: ray.get(index.longest_prefix.remote(keys)).length == 4)
    got, store = fetch()
    assert len(got) == 4 and all(np.array_equal(g, d) for g, d in zip(got, data))
    assert store.counters["nixl_blocks"] == 4 and ("n0", "dram") in readers
    old_pid = ray.get(dram.describe.remote())["pid"]
    ray.kill(dram, no_restart=False)

    def restarted() -> bool:
        described = _try(lambda: ray.get(dram.describe.remote(), timeout=5))
        return isinstance(described, dict) and described["pid"] != old_pid

    wait_for(restarted)
    assert all(ray.get(dram.put_many.remote(keys, data)))  # the restarted tier holds them again, in a new slab
    wait_for(lambda: ray.get(index.longest_prefix.remote(keys)).length == 4)
    got, store = fetch()  # the reader still knows the dead process's NIXL agent
    assert got == [] and store.counters["remote_failures"] == 1 and ("n0", "dram") not in readers
    got, store = fetch()  # a new reader connects to the new slab
    assert len(got) == 4 and all(np.array_equal(g, d) for g, d in zip(got, data))
    ray.get(dram.delete.remote(keys))


def test_a_sharded_index_answers_as_one_and_a_local_copy_follows_it(ray_session) -> None:
    """Three shards (own namespace): tier reports split by key hash, one lookup merges every shard's answer;
    a LocalIndex copy sees the same after a refresh, and a second start asking for another shard count is
    refused by name."""
    from kvcluster.actors.index_client import IndexClient, LocalIndex
    from kvcluster.block_index import shard_of
    from kvcluster.errors import ConfigError

    ns = "kvc-shards"
    start_global_actors(os.path.join(ray_session, "shards"), namespace=ns, index_shards=3)
    client = IndexClient.connect(namespace=ns)
    keys = [bytes(k) for k in KeySpace(model="shards").chain_hash_ids(list(range(12)))]
    assert client.shards == 3 and len({shard_of(k, 3) for k in keys}) == 3
    client.stored("n0", "dram", keys[:8])
    client.stored("n1", "pfs", keys[:4])
    match = wait_for(lambda: (m := client.longest_prefix(keys, timeout_s=10)).length == 8
                     and len(m.locations[0]) == 2 and m)
    assert match.locations[:4] == ((("n0", "dram"), ("n1", "pfs")),) * 4 and match.best_node() == "n0"
    assert client.occupancy() == {"n0": {"dram": 8}, "n1": {"pfs": 4}}
    local = LocalIndex(client, refresh_s=3600)  # refreshed by hand below
    try:
        assert local.longest_prefix(keys) == match
        client.removed("n0", "dram", keys[2:3])
        ray.get(client.lost("n1"))
        wait_for(lambda: client.longest_prefix(keys, timeout_s=10).length == 2)
        assert local.longest_prefix(keys).length == 8  # not refreshed yet: the copy lags, by design
        local.refresh()
        assert local.longest_prefix(keys) == client.longest_prefix(keys) and local.longest_prefix(keys).length == 2
    finally:
        local.close()
    with pytest.raises(ConfigError, match="index_shards: the running index has 3 shards"):
        start_global_actors(os.path.join(ray_session, "shards"), namespace=ns, index_shards=2)


def test_a_node_controller_pools_what_its_policy_learns_through_the_predictor(cluster_actors) -> None:
    """bayes in a node's controller sends its reuse-gap counts to the predictor every 2 stores; the predictor
    checkpoints them, and a controller started afresh begins from them instead of from nothing. The stores
    went through the writer's path: no KV byte reached the controller."""
    from kvcluster.actors.index_actor import NAMESPACE
    from kvcluster.actors.node_control_actor import NodeControlActor, control_name
    from kvcluster.actors.node_writer import NodeWriter

    _, predictor, dram, pfs = cluster_actors
    chain = [("n0/dram", "kvcluster/n0/dram", 8), ("n0/pfs", "kvcluster/n0/pfs", 64)]
    keys = [bytes(k) for k in KeySpace(model="gap").chain_hash_ids(list(range(4)))]
    control = NodeControlActor.options(name=control_name("n0"), namespace=NAMESPACE).remote(
        "n0", chain, "bayes", None, 4096, 2, gap_sync_min_s=0.0)
    writer = NodeWriter("n0")
    for i in range(4):
        landed = writer.store(keys[: i + 1], {keys[i]: payload(i)}, RequestContext(index=i, now=float(i), session="s"))
        assert landed == 1
    assert all(np.array_equal(g, payload(j)) for j, g in enumerate(ray.get(dram.get_many.remote(keys))))
    writer.flush()
    stats = ray.get(control.stats.remote())
    assert stats["gap_syncs"] == 3  # at start, then after stores 2 and 4
    assert stats["payload_bytes"] == 0 and stats["written"] == 4 and stats["in_flight"] == 0
    assert stats["gap_learned_uses"] >= 1 + 2 + 3 + 4  # with whatever earlier runs left in the predictor
    totals = ray.get(predictor.gap_totals.remote())
    assert totals.total_reached() == stats["gap_learned_uses"]
    ray.kill(control, no_restart=True)
    ray.get(predictor.checkpoint.remote())
    ray.kill(predictor, no_restart=False)
    wait_for(lambda: _try(lambda: ray.get(predictor.snapshot.remote(), timeout=5)))
    fresh = NodeControlActor.remote("n0", chain, "bayes", None, 4096, 2)
    try:
        restarted = ray.get(fresh.stats.remote())
        assert restarted["stores"] == 0 and restarted["gap_learned_uses"] == totals.total_reached() > 0
        assert restarted["adopted"] >= 4  # the dram tier's blocks (these four at least), back in its view
        with pytest.raises(ray.exceptions.RayTaskError):  # not a key; but counted first, so the 0 above means 0
            ray.get(fresh.lookup.remote([payload(0)]))
        assert ray.get(fresh.stats.remote())["payload_bytes"] == payload(0).nbytes
    finally:
        ray.kill(fresh, no_restart=True)
        ray.get(dram.delete.remote(keys))


def test_a_replica_store_passes_a_late_answer_to_its_hbm_policy_and_the_control_plane() -> None:
    """`answered` re-classes the request in this node's hbm policy and goes on to the node's controller, on the
    saver thread after the request's stores; outside a cluster it stays local."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcluster.policies.bayes import describe_class
    from kvcluster.serve_apps.cluster_store import ClusterBlockStore
    from kvcluster.serving.block_store import LocalBlockStore
    from kvcluster.storage import hbm_backend
    from kvcluster.storage.tiered import TieredStore

    class Writer:
        def __init__(self) -> None:
            self.told: list = []

        def answered(self, session, finish, output_tokens) -> None:
            self.told.append((session, finish, output_tokens))

        def flush(self) -> None:
            pass

    hbm = LocalBlockStore(TieredStore([hbm_backend(8, 64)], 64, "bayes"))
    store = ClusterBlockStore.__new__(ClusterBlockStore)  # the replica side only: no index or predictor actor
    store.hbm, store.node, store.writer, store._saver = hbm, "n0", Writer(), ThreadPoolExecutor(1)
    keys = KeySpace(model="late-answer").chain_hash_ids([1, 2])
    hbm.store(keys, [np.zeros(64, np.uint8)] * 2, session="alice")
    store.answered("alice", "stop", 12)
    store.flush()
    assert store.writer.told == [("alice", "stop", 12)]
    policy = hbm.tiered.hierarchy.policies[0]
    assert describe_class(policy._gcls[0]) == {"transition": "first", "session_gap": "first request",
                                              "finish": "end of turn", "first_answer": "< 32 tokens"}
    store.node = None  # a replica outside a cluster: its own hbm only
    store.answered("alice", "stop", 12)
    store.flush()
    assert len(store.writer.told) == 1


def test_a_closed_replica_store_finishes_what_it_was_handed_and_calls_nothing_after() -> None:
    """`close` waits for the stores in flight and stops the saver thread: a store handed over later stays in hbm
    and reaches no actor (a call after the process left Ray would start a new local Ray in that thread)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from kvcluster.serve_apps.cluster_store import ClusterBlockStore
    from kvcluster.serving.block_store import LocalBlockStore
    from kvcluster.storage import hbm_backend
    from kvcluster.storage.tiered import TieredStore

    release = threading.Event()

    class SlowWriter:
        def __init__(self) -> None:
            self.stored: list = []
            self.counters = {"control_unavailable": 0}

        def store(self, keys, new, ctx, pairs) -> int:
            release.wait()
            self.stored.append(list(keys))
            return 0

        def flush(self) -> None:
            pass

    store = ClusterBlockStore.__new__(ClusterBlockStore)  # the replica side only: no index or predictor actor
    store.hbm = LocalBlockStore(TieredStore([hbm_backend(8, 64)], 64))
    store.node, store.writer, store._saver = "n0", SlowWriter(), ThreadPoolExecutor(1)
    store._requests, store._queued, store._queue_lock, store._from_peers = 0, 0, threading.Lock(), set()
    first, later = (KeySpace(model="close").chain_hash_ids([i, i + 1]) for i in (1, 7))
    store.store(first, [np.ones(64, np.uint8)] * 2)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # the store in flight is waited for
    release.set()
    closer.join()
    assert store.writer.stored == [[bytes(k) for k in first]]
    store.store(later, [np.ones(64, np.uint8)] * 2)
    store.answered("s", "stop", 3)
    assert store.writer.stored == [[bytes(k) for k in first]] and store._saver._shutdown
    assert len(store.hbm.fetch(later)) == 2  # kept in this replica's hbm
