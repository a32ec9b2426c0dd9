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
from kvcluster.actors.ray_start import start_ray  # noqa: E402
from kvcluster.actors.tier_actor import TierActor, TierActorConfig  # noqa: E402
from kvcluster.keys import KeySpace  # noqa: E402
from ray_support import names_free  # noqa: E402

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
    c = start_ray(lambda: Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1},
                                                     "include_dashboard": False, **node_args}))
    node_a = start_ray(lambda: c.add_node(num_cpus=1, resources={"node_a": 1}, **node_args))
    node_b = start_ray(lambda: c.add_node(num_cpus=1, resources={"node_b": 1}, **node_args))
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    c.wait_for_nodes()
    yield c, node_a, node_b, tmp
    ray.shutdown()
    c.shutdown()


def wait_for(fn, timeout: float = 300.0):
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

    pfs_cfg = TierActorConfig.of(node="a", kind="pfs", slots=16, slot_bytes=1 << 16, path=os.path.join(tmp, "pfs"))
    pfs_a = TierActor.options(scheduling_strategy=pinned(node_a.node_id)).remote(pfs_cfg.model_dump())
    assert ray.get(pfs_a.put_many.remote(KEYS, data)) == [True] * 4

    c.remove_node(node_a)  # node A and everything in its memory is gone
    ray.get(index.lost.remote("a", "dram"))
    pfs_b = TierActor.options(scheduling_strategy=pinned(node_b.node_id)).remote(
        TierActorConfig.of(node="b", kind="pfs", slots=16, slot_bytes=1 << 16, path=os.path.join(tmp, "pfs")).model_dump())
    got = ray.get(pfs_b.get_many.remote(KEYS))
    assert all(np.array_equal(g, d) for g, d in zip(got, data))  # the shared filesystem still serves them
    assert ray.get(rdma_b.get_many.remote(KEYS), timeout=60) == [None] * 4  # A's memory is gone: misses


def test_cluster_cli_starts_reports_and_stops_the_actors(cluster, tmp_path) -> None:
    import json
    import subprocess
    import sys

    c, _, node_b, tmp = cluster
    names_free(INDEX_NAME, "kvcluster/cli-head/control", "kvcluster/cli-b/control")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"""
model: kvcluster-tiny-llama
checkpoint_dir: {tmp}/cli/predictor
index_shards: 2
nodes:
  - name: cli-head
    tiers: [{{kind: dram, capacity: 0.01GiB}}]
  - name: cli-b
    ray_resource: node_b
    tiers: [{{kind: dram, capacity: 0.01GiB}}, {{kind: pfs, capacity: 0.02GiB, path: {tmp}/cli/pfs}}]
""")

    def cli(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "kvcluster.cli", "cluster", *args, str(cfg), "--address",
                              c.address, "--json"], capture_output=True, text=True, timeout=120, env=os.environ)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    started = cli("up")
    assert len(started["tiers"]) == 3 and started["index_shards"] == 2
    assert started["controllers"] == ["kvcluster/cli-head/control", "kvcluster/cli-b/control"]
    status = cli("status")
    assert {node: s["tiers"] for node, s in status["control"].items()} == {
        "cli-head": ["cli-head/dram"], "cli-b": ["cli-b/dram", "cli-b/pfs"]}
    b_control = ray.get_actor("kvcluster/cli-b/control", namespace=NAMESPACE)
    assert ray.get(b_control.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())) \
        == node_b.node_id  # each node's controller runs on its node
    assert [(r["node"], r["tier"], r["state"], r["capacity_blocks"]) for r in status["tiers"]] == [
        ("cli-head", "dram", "running", 81), ("cli-b", "dram", "running", 81), ("cli-b", "pfs", "running", 163)]
    b_dram = ray.get_actor("kvcluster/cli-b/dram", namespace=NAMESPACE)
    assert ray.get(b_dram.put_many.remote(KEYS[:2], [np.zeros(131072, np.uint8)] * 2)) == [True, True]
    assert wait_for(lambda: cli("status")["tiers"][1]["used_blocks"] == 2)
    killed = cli("down")["killed"]
    assert {"kvcluster/cli-b/pfs", "kvcluster/cli-head/control", "kvcluster/cli-b/control", "kvcluster/index",
            "kvcluster/index/1"} <= set(killed)
    assert all(r["state"] == "absent" for r in cli("status")["tiers"])


def test_cluster_cli_names_the_bad_field(tmp_path, capsys) -> None:
    from kvcluster.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: kvcluster-tiny-llama\ncheckpoint_dir: /tmp/x\nnodes: [{name: n0, tiers: [{kind: tape, capacity: 1GiB}]}]\n")
    assert main(["cluster", "up", str(bad)]) == 2
    assert "field nodes.0.tiers.0.kind" in capsys.readouterr().err


def test_cluster_cli_without_a_cluster_is_one_clear_line() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvcluster.cli", "cluster", "status", "local", "--address",
                          "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no Ray cluster at --address '127.0.0.1:1'" in out.stderr
    assert "Traceback" not in out.stderr


def test_each_node_controller_places_its_own_writers_blocks_and_a_reader_copies_a_peers_home(cluster) -> None:
    """Two nodes, a controller on each over its own dram: blocks an engine on the head computed land in the
    head's dram, written by the engine itself (the controller only named the tier); a replica on B that reads
    them from the head's slab over NIXL stores them in B's own dram through B's controller, and the index
    lists both copies. No KV byte reached either controller."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcluster.actors.node_control_actor import NodeControlActor, control_name
    from kvcluster.actors.node_writer import NodeWriter
    from kvcluster.actors.predictor_actor import PREDICTOR_NAME, PredictorActor
    from kvcluster.serve_apps.cluster_store import ClusterBlockStore
    from kvcluster.serving.block_store import LocalBlockStore
    from kvcluster.storage import hbm_backend
    from kvcluster.storage.tiered import TieredStore

    _, _, node_b, tmp = cluster
    head_id = ray.get_runtime_context().get_node_id()
    names_free(INDEX_NAME, PREDICTOR_NAME, control_name("h"), control_name("b"), "kvcluster/h/dram",
               "kvcluster/b/dram")
    index = IndexActor.options(name=INDEX_NAME, scheduling_strategy=pinned(head_id)).remote()
    predictor = PredictorActor.options(name=PREDICTOR_NAME, namespace=NAMESPACE).remote(os.path.join(tmp, "ctl"))
    cfg = dict(slots=8, slot_bytes=1 << 16)
    drams, controls = {}, {}
    for node, where in (("h", head_id), ("b", node_b.node_id)):
        drams[node] = TierActor.options(name=f"kvcluster/{node}/dram", namespace=NAMESPACE,
                                        scheduling_strategy=pinned(where)).remote(
            TierActorConfig.of(node=node, kind="dram", **cfg).model_dump())
        ray.get(drams[node].describe.remote())
        controls[node] = NodeControlActor.options(name=control_name(node), namespace=NAMESPACE,
                                                  scheduling_strategy=pinned(where)).remote(
            node, [(f"{node}/dram", f"kvcluster/{node}/dram", 8)], "lru")
    data = [np.random.default_rng(10 + i).integers(0, 255, 40_000, dtype=np.uint8) for i in range(3)]
    head_writer = NodeWriter("h")
    assert head_writer.store(KEYS[:3], dict(zip(KEYS[:3], data))) == 3  # computed on the head
    head_writer.flush()
    assert all(np.array_equal(g, d) for g, d in zip(ray.get(drams["h"].get_many.remote(KEYS[:3])), data))
    assert ray.get(drams["b"].get_many.remote(KEYS[:3])) == [None] * 3
    wait_for(lambda: ray.get(index.longest_prefix.remote(KEYS[:3])).length == 3)

    reader = ClusterBlockStore(LocalBlockStore(TieredStore([hbm_backend(8, 1 << 16)], 1 << 16, "lru")), "b")
    got = reader.fetch(KEYS[:3])
    assert len(got) == 3 and all(np.array_equal(g[: d.nbytes], d) for g, d in zip(got, data))
    reader.store(KEYS[:3], [None] * 3)  # nothing computed: the blocks it read from the head are kept here too
    reader.flush()
    got = ray.get(drams["b"].get_many.remote(KEYS[:3]))
    assert all(g is not None and np.array_equal(g[: d.nbytes], d) for g, d in zip(got, data))
    assert all(np.array_equal(g, d) for g, d in zip(ray.get(drams["h"].get_many.remote(KEYS[:3])), data))
    wait_for(lambda: all(len(locs) == 2 for locs in ray.get(index.longest_prefix.remote(KEYS[:3])).locations))
    stats = {node: ray.get(c.stats.remote()) for node, c in controls.items()}
    assert [s["written"] for s in stats.values()] == [3, 3]
    assert [s["payload_bytes"] for s in stats.values()] == [0, 0]
    assert ray.get(controls["b"].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())) \
        == node_b.node_id

    # the head's controller dies: only the head's placements pause; B's go on; nothing the head's tier holds is lost
    ray.kill(controls["h"], no_restart=True)
    more = [np.random.default_rng(30 + i).integers(0, 255, 40_000, dtype=np.uint8) for i in range(1)]
    paused = NodeWriter("h", timeout_s=30)
    assert paused.store(KEYS[3:4], {KEYS[3]: more[0]}) == 0 and paused.counters["control_unavailable"] == 1
    assert ray.get(drams["h"].get_many.remote(KEYS[3:4])) == [None]  # not written: a miss, never unplaced bytes
    b_writer = NodeWriter("b")
    assert b_writer.store(KEYS[3:4], {KEYS[3]: more[0]}) == 1
    b_writer.flush()
    controls["h"] = NodeControlActor.options(name=control_name("h"), namespace=NAMESPACE,
                                             scheduling_strategy=pinned(head_id)).remote(
        "h", [("h/dram", "kvcluster/h/dram", 8)], "lru")
    assert ray.get(controls["h"].stats.remote())["adopted"] == 3  # its view rebuilt from its own tier
    head_writer = NodeWriter("h")
    assert head_writer.store(KEYS[3:4], {KEYS[3]: more[0]}) == 1  # and placing again
    head_writer.flush()
    assert ray.get(controls["h"].stats.remote())["written"] == 1
    for actor in (*controls.values(), *drams.values(), index, predictor):
        ray.kill(actor, no_restart=True)


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
        TierActorConfig.of(node="b", kind="dram", slots=8, slot_bytes=1 << 16).model_dump())
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
        TierActorConfig.of(node="b", kind="dram", slots=8, slot_bytes=1 << 15).model_dump())
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
