"""The pooled tier live on four Ray nodes (ray.cluster_utils.Cluster): the same hits as `replay_cluster`, on bytes
read back from the node tiers and the pool's storage; a dead node's share of the pool forgotten, never served."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from kvcluster.actors.index_actor import INDEX_NAME, NAMESPACE, IndexActor  # noqa: E402
from kvcluster.actors.live_cluster_replay import LentDramPool, replay_cluster_live  # noqa: E402
from kvcluster.actors.ray_start import start_ray  # noqa: E402
from kvcluster.actors.live_replay import block_key, block_payload  # noqa: E402
from kvcluster.actors.pool_manager_actor import POOL_MANAGER_NAME, PoolManagerActor  # noqa: E402
from kvcluster.cluster_sim import ClusterPlan  # noqa: E402
from kvcluster.hierarchy import TierPlan  # noqa: E402
from kvcluster.policies.base import RequestContext  # noqa: E402
from kvcluster.simulator import prepare  # noqa: E402
from kvcluster.traces import load_trace  # noqa: E402

from data_support import require_data, require_tokenizer  # noqa: E402
from ray_support import names_free  # noqa: E402

pytestmark = pytest.mark.slow
NODES = 4


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="kvc", dir="/tmp")  # short socket paths, a Ray of its own
    args = {"num_cpus": 1, "object_store_memory": 96 << 20}
    c = start_ray(lambda: Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False}))
    workers = [start_ray(lambda: c.add_node(**args)) for _ in range(NODES - 1)]
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    c.wait_for_nodes()
    yield c, [ray.get_runtime_context().get_node_id()] + [w.node_id for w in workers], workers
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def trace():
    """40 ShareGPT conversations: 180 requests of 22 sessions, 43,672 block references of 4,094 blocks."""
    require_tokenizer()
    return prepare(load_trace(str(require_data("sharegpt_v3", "sharegpt_v3_subset.jsonl")), max_records=40))


def plan_of(trace) -> ClusterPlan:
    """2% of the blocks node-local (split over the nodes) and 8% pooled: both local and pool hits."""
    return ClusterPlan((TierPlan("local", trace.unique_blocks // 50),), TierPlan("pool", trace.unique_blocks // 12))


def test_four_nodes_with_a_shared_file_pool_hit_what_the_simulator_replays(cluster, trace) -> None:
    _, ray_nodes, _ = cluster
    out = replay_cluster_live(trace, "bayes", plan_of(trace), ray_nodes, pool_storage="pfs")
    live, simulated = out["live"], out["simulated"]
    assert out["wrong_bytes"] == 0 and out["misses_on_read"] == 0 and out["pool_unavailable"] == 0
    assert out["control_payload_bytes"] == 0 and out["pool_payload_bytes"] == 0  # bytes never went through control
    assert (live["local_hits"], live["pool_hits"]) == (simulated["local_hits"], simulated["pool_hits"])
    assert live["local_hits"] > 0 and live["pool_hits"] > 0
    assert out["max_abs_diff"] == 0.0
    assert out["pool"]["calls"] == trace.requests  # one manager call per request, never one per block
    assert out["pool"]["blocks"] <= plan_of(trace).pool.capacity_blocks


def restarted(manager) -> dict:
    """Kill the manager's process and wait for Ray to restart it; its stats once it answers from a new process."""
    pid = ray.get(manager.pid.remote(), timeout=300)
    os.kill(pid, 9)
    deadline = time.monotonic() + 300
    while True:
        try:
            if ray.get(manager.pid.remote(), timeout=60) != pid:
                return ray.get(manager.stats.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # restarting
        assert time.monotonic() < deadline, "the pool manager did not come back"
        time.sleep(0.2)


def test_a_restarted_pool_manager_adopts_the_shared_directory_and_trims_what_does_not_fit(cluster, tmp_path) -> None:
    """The manager's process dies; Ray restarts it, and it takes back what the pool's directory holds: the
    blocks it had placed are found and read again; a file beyond its capacity is deleted."""
    from kvcluster.actors.live_cluster_replay import SharedFilePool
    from kvcluster.storage import PFSBackend

    _, ray_nodes, _ = cluster
    names_free(POOL_MANAGER_NAME)
    head = NodeAffinitySchedulingStrategy(ray_nodes[0], soft=False)
    storage = SharedFilePool(tmp_path / "pool", 4, 512)
    manager = PoolManagerActor.options(name=POOL_MANAGER_NAME, namespace=NAMESPACE, scheduling_strategy=head).remote(
        "lru", 4, None, (str(storage.root), "pfs"))
    keys = [block_key(b) for b in range(4)]
    where, write, delete = ray.get(manager.lookup_access.remote(keys, RequestContext(0, 0.0), "pfs"), timeout=300)
    assert where == [None] * 4 and write == keys and not delete
    assert storage.write("pfs", write, [block_payload(k, 512) for k in write], delete) == ([], [])
    orphan = block_key(99)  # a file the manager never placed (a writer that crashed before telling it)
    assert PFSBackend(storage.root, 1 << 30).put_many([(orphan, block_payload(orphan, 512))]) == [True]

    stats = restarted(manager)
    assert stats["adopted"] == 4 and stats["blocks"] == 4 and stats["calls"] == 0
    assert len(storage.backend.keys()) == 4  # one of the five files deleted: no room for it
    held = [k for k in keys + [orphan] if ray.get(manager.lookup.remote([k]))[0] == "pfs"]
    assert len(held) == 4 and sorted(held) == sorted(storage.backend.keys())
    got, dead = storage.read({"pfs": held})
    assert not dead and all(np.array_equal(got[k], block_payload(k, 512)) for k in held)
    ray.kill(manager, no_restart=True)


def test_a_dead_nodes_share_of_a_lent_dram_pool_is_forgotten_not_served(cluster) -> None:
    """Blocks written through by nodes 0 and 3 live in the DRAM each lent. The manager's process dies: restarted,
    it takes back what each share holds. Then node 3 dies: a reader finds its share gone, the manager forgets
    what it held (lookups no longer return it), the rest still reads right."""
    c, ray_nodes, workers = cluster
    names_free(INDEX_NAME, POOL_MANAGER_NAME, LentDramPool.share_name("node0"), LentDramPool.share_name("node3"))
    head = NodeAffinitySchedulingStrategy(ray_nodes[0], soft=False)  # the global actors live on the head, which stays
    index = IndexActor.options(name=INDEX_NAME, namespace=NAMESPACE, scheduling_strategy=head).remote()
    names = [f"node{i}" for i in range(NODES)]
    storage = LentDramPool()
    shares = storage.start(names, ray_nodes, 16, 512)
    manager = PoolManagerActor.options(name=POOL_MANAGER_NAME, namespace=NAMESPACE, scheduling_strategy=head).remote(
        "lru", 16, None, None, list(storage.shares))
    ray.get([s.describe.remote() for s in shares], timeout=300)
    mine, theirs = [block_key(b) for b in range(4)], [block_key(b) for b in range(10, 14)]
    for i, (keys, node) in enumerate(((mine, "node0"), (theirs, "node3"))):
        at = storage.location(node)
        where, write, delete = ray.get(manager.lookup_access.remote(keys, RequestContext(i, float(i)), at))
        assert where == [None] * 4 and write == keys and not delete
        assert storage.write(at, write, [block_payload(k, 512) for k in write], delete) == ([], [])
    assert ray.get(manager.lookup.remote(theirs)) == [storage.location("node3")] * 4
    got, dead = storage.read({storage.location("node3"): theirs})
    assert not dead and all(np.array_equal(got[k], block_payload(k, 512)) for k in theirs)
    assert storage.counters == {"nixl_blocks": 4, "actor_blocks": 0}  # read over NIXL, not through the actor

    stats = restarted(manager)
    assert stats["adopted"] == 8 and stats["calls"] == 0  # both shares listed, nothing asked of it yet
    assert ray.get(manager.lookup.remote(mine + theirs)) == [storage.location("node0")] * 4 + [
        storage.location("node3")] * 4

    c.remove_node(workers[-1])  # node 3, its lent DRAM with it
    deadline = time.monotonic() + 300
    while True:  # a reader finds the share dead (the actor's death reaches the driver asynchronously)
        got, dead = storage.read({storage.location("node3"): theirs})
        assert all(v is None for v in got.values())  # misses meanwhile, never bytes
        if dead:
            break
        assert time.monotonic() < deadline, "node 3's share is not reported dead"
        time.sleep(0.2)
    assert dead == [storage.location("node3")]
    assert ray.get(manager.lost.remote(dead[0])) == 4  # what the replay's reader tells the manager
    assert ray.get(manager.lookup.remote(theirs)) == [None] * 4  # forgotten: never sent there again
    got, dead = storage.read({storage.location("node0"): mine})
    assert all(np.array_equal(got[k], block_payload(k, 512)) for k in mine)
    stats = ray.get(manager.stats.remote())
    assert stats["blocks"] == 4 and stats["lost"] == 4 and stats["payload_bytes"] == 0
    where, write, _ = ray.get(manager.lookup_access.remote(theirs, RequestContext(2, 2.0), storage.location("node0")))
    assert where == [None] * 4 and write == theirs  # a miss, written again where a live node lends
    assert storage.counters["nixl_blocks"] == 8  # node 0's share too
    storage.close()
    for actor in shares[:-1] + [manager, index]:
        ray.kill(actor, no_restart=True)
