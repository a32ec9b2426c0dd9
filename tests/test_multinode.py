"""Several Ray nodes on one machine (ray.cluster_utils.Cluster): cross-node reads over NIXL, node loss."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from kvcluster.actors.index_actor import INDEX_NAME, NAMESPACE, IndexActor  # noqa: E402
from kvcluster.actors.peer_pool_actor import PeerPoolActor, RdmaTierActor  # noqa: E402
from kvcluster.actors.tier_actor import TierActor, TierActorConfig  # noqa: E402
from kvcluster.keys import KeySpace  # noqa: E402

KEYS = [bytes(k) for k in KeySpace(model="multinode").chain_hash_ids(list(range(4)))]
pytestmark = pytest.mark.slow


def pinned(node_id: str):
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="kvc", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp  # short socket paths, and nothing shared with other Ray instances
    node_args = {"object_store_memory": 128 << 20}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1},
                                                     "include_dashboard": False, **node_args})
    node_a = c.add_node(num_cpus=1, resources={"node_a": 1}, **node_args)
    node_b = c.add_node(num_cpus=1, resources={"node_b": 1}, **node_args)
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    c.wait_for_nodes()
    yield c, node_a, node_b, tmp
    ray.shutdown()
    c.shutdown()


def names_free(*names: str, timeout: float = 60.0) -> None:
    """Wait until the named actors an earlier test held are gone (their handles die asynchronously)."""
    deadline = time.monotonic() + timeout
    for name in names:
        while True:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"actor {name} from an earlier test is still alive")
            time.sleep(0.2)


def wait_for(fn, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = fn()
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("condition not reached")


def replica_store(slot_bytes: int, **options):
    """A replica's fetch path on node "h" (kvcluster.serve_apps.cluster_store), its own hbm empty."""
    from kvcluster.serve_apps.cluster_store import ClusterBlockStore
    from kvcluster.serving.block_store import LocalBlockStore
    from kvcluster.storage import hbm_backend
    from kvcluster.storage.tiered import TieredStore

    return ClusterBlockStore(LocalBlockStore(TieredStore([hbm_backend(8, slot_bytes)], slot_bytes)), "h", timeout_s=10,
                             **options)


def fetch_into_pages(store, data: list[np.ndarray], targets: tuple[int, ...]) -> set[int]:
    """KEYS fetched into blocks `targets` of an engine's paged KV (4 layers of 8 KiB pages, registered with the
    store): the pages and the payloads promoted into hbm hold `data`. Returns the positions already in their
    pages."""
    paged = torch.zeros((4, 6, 1 << 13), dtype=torch.uint8)
    pages = [[paged[layer, b] for layer in range(4)] for b in targets]
    store.register(paged)
    got, placed = store.fetch_placed(KEYS, None, pages)
    assert all(torch.equal(torch.cat(p), torch.from_numpy(d)) for p, d in zip(pages, data))
    assert len(got) == len(data) and all(np.array_equal(g, d) for g, d in zip(got, data))
    return placed


def test_a_block_written_on_a_is_read_from_b_over_nixl_and_pfs_outlives_its_node(cluster) -> None:
    c, node_a, node_b, tmp = cluster
    head_id = ray.get_runtime_context().get_node_id()
    names_free(INDEX_NAME)
    index = IndexActor.options(name=INDEX_NAME, scheduling_strategy=pinned(head_id)).remote()
    pool_a = PeerPoolActor.options(name="kvcluster/a/pool", scheduling_strategy=pinned(node_a.node_id)).remote(
        "a", 8, 1 << 16)
    data = [np.random.default_rng(i).integers(0, 255, 1 << 15, dtype=np.uint8) for i in range(len(KEYS))]
    assert ray.get(pool_a.put_local.remote(KEYS, data)) == [True] * 4
    rdma_b = RdmaTierActor.options(scheduling_strategy=pinned(node_b.node_id)).remote("b", "a", 1 << 18, 8)
    got = ray.get(rdma_b.get_many.remote(KEYS))
    assert all(np.array_equal(g, d) for g, d in zip(got, data))  # bytes crossed nodes through NIXL
    assert ray.get(index.longest_prefix.remote(KEYS)).best_node() == "a"

    pfs_cfg = TierActorConfig(node="a", tier="pfs", slots=16, slot_bytes=1 << 16, path=os.path.join(tmp, "pfs"))
    pfs_a = TierActor.options(scheduling_strategy=pinned(node_a.node_id)).remote(pfs_cfg.model_dump())
    assert ray.get(pfs_a.put_many.remote(KEYS, data)) == [True] * 4

    c.remove_node(node_a)  # node A and everything in its memory is gone
    ray.get(index.lost.remote("a", "dram"))
    pfs_b = TierActor.options(scheduling_strategy=pinned(node_b.node_id)).remote(
        TierActorConfig(node="b", tier="pfs", slots=16, slot_bytes=1 << 16, path=os.path.join(tmp, "pfs")).model_dump())
    got = ray.get(pfs_b.get_many.remote(KEYS))
    assert all(np.array_equal(g, d) for g, d in zip(got, data))  # the shared filesystem still serves them
    assert ray.get(rdma_b.get_many.remote(KEYS), timeout=60) == [None] * 4  # A's memory is gone: misses


def test_cluster_cli_starts_reports_and_stops_the_actors(cluster, tmp_path) -> None:
    import json
    import subprocess
    import sys

    c, _, node_b, tmp = cluster
    names_free(INDEX_NAME, "kvcluster/control")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"""
model: kvcluster-tiny-llama
checkpoint_dir: {tmp}/cli/predictor
index_shards: 2
control_shards: 2
nodes:
  - name: cli-head
    tiers: [{{tier: dram, capacity_gib: 0.01}}]
  - name: cli-b
    ray_resource: node_b
    tiers: [{{tier: dram, capacity_gib: 0.01}}, {{tier: pfs, capacity_gib: 0.02, path: {tmp}/cli/pfs}}]
""")

    def cli(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "kvcluster.cli", "cluster", *args, str(cfg), "--address",
                              c.address, "--json"], capture_output=True, text=True, timeout=120, env=os.environ)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    started = cli("up")
    assert len(started["tiers"]) == 3 and started["control_shards"] == started["index_shards"] == 2
    status = cli("status")
    assert [(s["shard"], s["shards"], s["tiers"]) for s in status["control"]] == [
        (i, 2, {"cli-head": ["cli-head/dram"], "cli-b": ["cli-b/dram", "cli-b/pfs"]}) for i in range(2)]
    assert [(r["node"], r["tier"], r["state"], r["capacity_blocks"]) for r in status["tiers"]] == [
        ("cli-head", "dram", "running", 81), ("cli-b", "dram", "running", 81), ("cli-b", "pfs", "running", 163)]
    b_dram = ray.get_actor("kvcluster/cli-b/dram", namespace=NAMESPACE)
    assert ray.get(b_dram.put_many.remote(KEYS[:2], [np.zeros(131072, np.uint8)] * 2)) == [True, True]
    assert wait_for(lambda: cli("status")["tiers"][1]["used_blocks"] == 2)
    killed = cli("down")["killed"]
    assert {"kvcluster/cli-b/pfs", "kvcluster/control", "kvcluster/control/1", "kvcluster/index",
            "kvcluster/index/1"} <= set(killed)
    assert all(r["state"] == "absent" for r in cli("status")["tiers"])


def test_cluster_cli_names_the_bad_field(tmp_path, capsys) -> None:
    from kvcluster.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: kvcluster-tiny-llama\ncheckpoint_dir: /tmp/x\nnodes: [{name: n0, tiers: [{tier: tape, capacity_gib: 1}]}]\n")
    assert main(["cluster", "up", str(bad)]) == 2
    assert "field nodes.0.tiers.0.tier" in capsys.readouterr().err


def test_cluster_cli_without_a_cluster_is_one_clear_line() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvcluster.cli", "cluster", "status", "local", "--address",
                          "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no Ray cluster at --address '127.0.0.1:1'" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_control_plane_migrates_a_block_between_nodes_over_nixl(cluster) -> None:
    """Blocks computed on the head and then used by a replica on node B move to B's dram: B's NIXL agent reads
    the head's slab into its own slots, then the head's copy goes (the block lives in one node's hierarchy)."""
    from kvcluster.actors.control_plane_actor import CONTROL_NAME, ControlPlaneActor

    _, _, node_b, _ = cluster
    head_id = ray.get_runtime_context().get_node_id()
    names_free(INDEX_NAME, CONTROL_NAME, "kvcluster/h/dram", "kvcluster/b/dram")
    index = IndexActor.options(name=INDEX_NAME, scheduling_strategy=pinned(head_id)).remote()
    cfg = dict(slots=8, slot_bytes=1 << 16)
    head_dram = TierActor.options(name="kvcluster/h/dram", namespace=NAMESPACE, scheduling_strategy=pinned(head_id)
                                  ).remote(TierActorConfig(node="h", tier="dram", **cfg).model_dump())
    b_dram = TierActor.options(name="kvcluster/b/dram", namespace=NAMESPACE,
                               scheduling_strategy=pinned(node_b.node_id)).remote(
        TierActorConfig(node="b", tier="dram", **cfg).model_dump())
    ray.get([head_dram.describe.remote(), b_dram.describe.remote()])  # named and up before the control plane looks
    control = ControlPlaneActor.options(name=CONTROL_NAME, namespace=NAMESPACE).remote(
        {"h": [("h/dram", "kvcluster/h/dram", 8)], "b": [("b/dram", "kvcluster/b/dram", 8)]}, "lru")
    data = [np.random.default_rng(10 + i).integers(0, 255, 40_000, dtype=np.uint8) for i in range(3)]
    assert ray.get(control.commit.remote("h", KEYS[:3], data), timeout=120) == 0  # computed on the head
    assert all(np.array_equal(g, d) for g, d in zip(ray.get(head_dram.get_many.remote(KEYS[:3])), data))
    assert ray.get(control.commit.remote("b", KEYS[:3], [None] * 3), timeout=120) == 0  # used by a replica on B
    totals = ray.get(control.stats.remote())["totals"]
    assert totals["pulled"] == 3 and totals["migrated"] == 3 and totals["failed"] == 0
    got = ray.get(b_dram.get_many.remote(KEYS[:3]))
    assert all(np.array_equal(g, d) for g, d in zip(got, data))  # checksummed bytes, moved node to node
    assert ray.get(head_dram.get_many.remote(KEYS[:3])) == [None] * 3  # the source copy went after they landed
    stats = ray.get(b_dram.stats.remote())
    assert stats["nixl_pulled_blocks"] == 3 and stats["nixl_direct_reads"] == 1  # landed in B's own slots
    assert stats["blocks"] == 3 and stats["used_bytes"] == 3 * cfg["slot_bytes"]
    again = ray.get(b_dram.pull.remote("kvcluster/h/dram", KEYS[:3] + [b"\x07" * 16]), timeout=60)
    assert again == [True, True, True, None]  # already here: nothing moved; unknown at the source: None
    assert ray.get(b_dram.stats.remote())["blocks"] == 3
    wait_for(lambda: ray.get(index.longest_prefix.remote(KEYS[:3])).locations == ((("b", "dram"),),) * 3)
    ray.kill(control)


def test_a_replica_store_survives_the_loss_of_the_node_holding_its_prefix(cluster) -> None:
    """The replica's fetch path (kvcluster.serve_apps.cluster_store) reads node B's dram, into rows or straight into
    registered pages (through rows when the memory cannot be registered); once B is removed its blocks are misses
    and the fetch still returns, without an error."""
    from kvcluster.actors.predictor_actor import PREDICTOR_NAME, PredictorActor

    c, _, node_b, tmp = cluster
    head_id = ray.get_runtime_context().get_node_id()
    names_free(INDEX_NAME, PREDICTOR_NAME, "kvcluster/b/dram")
    index = IndexActor.options(name=INDEX_NAME, scheduling_strategy=pinned(head_id)).remote()
    predictor = PredictorActor.options(name=PREDICTOR_NAME, namespace=NAMESPACE).remote(os.path.join(tmp, "loss"))
    b_dram = TierActor.options(name="kvcluster/b/dram", namespace=NAMESPACE,
                               scheduling_strategy=pinned(node_b.node_id)).remote(
        TierActorConfig(node="b", tier="dram", slots=8, slot_bytes=1 << 16).model_dump())
    data = [np.random.default_rng(20 + i).integers(0, 255, 1 << 15, dtype=np.uint8) for i in range(len(KEYS))]
    assert ray.get(b_dram.put_many.remote(KEYS, data)) == [True] * 4
    wait_for(lambda: ray.get(index.longest_prefix.remote(KEYS)).length == 4)

    def fresh_store():
        return replica_store(1 << 16)

    got = fresh_store().fetch(KEYS)
    assert len(got) == 4 and all(np.array_equal(g, d) for g, d in zip(got, data))

    store = fresh_store()  # an engine's paged KV registered: B's blocks land straight in their pages
    assert fetch_into_pages(store, data, (5, 0, 3, 1)) == {0, 1, 2, 3} and store.counters["nixl_in_place"] == 4
    store = fresh_store()
    store.register(torch.empty(1 << 15, dtype=torch.uint8, device="meta"))  # memory NIXL cannot register
    got, placed = store.fetch_placed(KEYS, None, [[torch.zeros(1 << 13, dtype=torch.uint8)] * 4] * 4)
    assert placed == set() and all(np.array_equal(g, d) for g, d in zip(got, data))  # the staged path instead
    c.remove_node(node_b)
    store = fresh_store()
    assert store.fetch(KEYS) == []  # B's memory is gone: misses, recomputed by the replica
    assert store.counters["remote_failures"] == 1  # one (node, tier) group, b/dram, whose one read failed
    del predictor


def test_an_engines_lent_pages_are_read_from_another_node_and_forgotten_when_it_dies(cluster) -> None:
    """An engine on A lends its paged KV (here: this process's pages, a `NixlRegionLender`, and the lent-pages
    actor on A): a replica store on another node reads the blocks from those pages, preferring them to B's dram
    copy (hbm is faster). When the engine dies without retiring (its actor killed, its agent gone), the next
    read takes B's copy instead (each block's next copy), and the store tells the index the lender is gone, so
    the reads after that go to B's copy first."""
    from kvcluster.actors.lent_pages_actor import LentPagesActor
    from kvcluster.actors.predictor_actor import PREDICTOR_NAME, PredictorActor
    from kvcluster.integrations.vllm.lending import LentBlocks, page_digest
    from kvcluster.integrations.vllm.paged_kv import PagedKV
    from kvcluster.storage import NixlRegionLender

    tmp = cluster[3]  # earlier tests removed nodes: every actor runs on the head, named for its node
    head_id = ray.get_runtime_context().get_node_id()
    names_free(INDEX_NAME, PREDICTOR_NAME, "kvcluster/b/dram", "kvcluster/a/hbm")
    index = IndexActor.options(name=INDEX_NAME, scheduling_strategy=pinned(head_id)).remote()
    predictor = PredictorActor.options(name=PREDICTOR_NAME, namespace=NAMESPACE).remote(os.path.join(tmp, "lent"))
    layers = [torch.from_numpy(np.random.default_rng(30 + i).integers(0, 255, (6, 1 << 13), dtype=np.uint8))
              for i in range(4)]
    kv = PagedKV(layers, [f"l{i}" for i in range(4)], 6, 1 << 13)
    held = [4, 1, 2, 5]  # the engine's blocks holding KEYS
    data = [torch.cat(kv.block_pages(b)).numpy().copy() for b in held]
    b_dram = TierActor.options(name="kvcluster/b/dram", namespace=NAMESPACE,
                               scheduling_strategy=pinned(head_id)).remote(
        TierActorConfig(node="b", tier="dram", slots=8, slot_bytes=1 << 15).model_dump())
    assert ray.get(b_dram.put_many.remote(KEYS, data)) == [True] * 4
    lender = NixlRegionLender(kv.regions)
    lent_actor = LentPagesActor.options(name="kvcluster/a/hbm", namespace=NAMESPACE,
                                        scheduling_strategy=pinned(head_id)).remote(
        "a", lender.metadata, lender.descs, kv.row_bytes, lender.name)
    lent = LentBlocks()
    for key, b in zip(KEYS, held):
        lent.lend(key, b, kv.row_bytes, page_digest(kv.block_pages(b)))
    ray.get(lent_actor.update.remote(*lent.drain()))
    wait_for(lambda: ray.get(index.longest_prefix.remote(KEYS)).locations == ((("a", "hbm"), ("b", "dram")),) * 4)

    def fresh_store():
        return replica_store(1 << 15)

    store = fresh_store()  # the reader's own engine's pages registered: read page to page from the lender's
    assert fetch_into_pages(store, data, (0, 3, 5, 1)) == {0, 1, 2, 3} and store.counters["lent_pages"] == 4
    store = replica_store(1 << 15, nixl_staging_bytes=None)  # reads nothing over NIXL: lent pages are no copy to it
    got = store.fetch(KEYS)
    assert all(np.array_equal(g, d) for g, d in zip(got, data)) and len(got) == 4
    assert (store.counters["lent_pages"], store.counters["second_copies"], store.counters["dram"]) == (0, 0, 4)

    ray.kill(lent_actor)  # the engine crashes: no retire, its agent gone with it
    lender.close()
    names_free("kvcluster/a/hbm")
    store = fresh_store()
    got = store.fetch(KEYS)  # the lent pages are gone: each block from its next copy
    assert all(np.array_equal(g, d) for g, d in zip(got, data)) and len(got) == 4
    assert (store.counters["lenders_gone"], store.counters["second_copies"], store.counters["dram"]) == (1, 4, 4)
    wait_for(lambda: ray.get(index.longest_prefix.remote(KEYS)).locations == ((("b", "dram"),),) * 4)
    store = fresh_store()
    got = store.fetch(KEYS)
    assert all(np.array_equal(g, d) for g, d in zip(got, data)) and store.counters["second_copies"] == 0
    for actor in (b_dram, index, predictor):
        ray.kill(actor)
