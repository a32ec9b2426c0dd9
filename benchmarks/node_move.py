"""Moving blocks between two Ray nodes: NIXL (rdma tier) vs the Ray object store (the control plane's fallback).

A `ray.cluster_utils.Cluster` with two worker nodes on this machine. Node A
owns a NIXL-registered pool (`PeerPoolActor`) and a plain dram tier actor
holding the same blocks. On node B, (1) the rdma tier actor reads them over
NIXL (one control call + one NIXL transfer per batch), (2) B's dram tier actor
`pull`s them from A's dram tier actor over NIXL into its own pool (how the
control plane migrates a block from another node's memory tier), (3) a dram
tier actor pulls them as Ray objects (`get_many` on A, `put_many` on B: the
control plane's path for sources NIXL cannot serve), and
(4) a bare Ray call returning the same bytes as one numpy array is the
reference. UCX runs over loopback here, so this compares software paths,
not an RDMA NIC.

    .venv/bin/python benchmarks/node_move.py [--blocks 32] [--block-kib 512] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from harness import JsonOutput, best_of  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from kvcluster.actors.index_actor import INDEX_NAME, NAMESPACE, IndexActor  # noqa: E402
from kvcluster.actors.ray_start import start_ray  # noqa: E402
from kvcluster.actors.peer_pool_actor import PeerPoolActor, RdmaTierActor  # noqa: E402
from kvcluster.actors.tier_actor import TierActor, TierActorConfig  # noqa: E402
from kvcluster.cli import positive_int  # noqa: E402
from kvcluster.keys import KeySpace  # noqa: E402


@ray.remote(num_cpus=0)
class Mover:
    """On node B: pulls from A's dram tier actor through the object store, or from a bare array source."""

    def __init__(self, dst) -> None:
        self.dst = dst

    def pull_objects(self, src, keys: list[bytes]) -> int:
        payloads = ray.get(src.get_many.remote(keys))
        return sum(ray.get(self.dst.put_many.remote(keys, payloads)))

    def pull_raw(self, src) -> int:
        return ray.get(src.blob.remote()).nbytes


@ray.remote(num_cpus=0)
class Blob:
    def __init__(self, nbytes: int) -> None:
        self.data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)

    def blob(self) -> np.ndarray:
        return self.data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=positive_int, default=32)
    parser.add_argument("--block-kib", type=positive_int, default=512)
    parser.add_argument("--repeat", type=positive_int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = JsonOutput(args.json)
    tmp = tempfile.mkdtemp(prefix="kvn", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    node_args = {"num_cpus": 1, "object_store_memory": 256 << 20}
    c = start_ray(lambda: Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False}))
    a, b = start_ray(lambda: c.add_node(**node_args)), start_ray(lambda: c.add_node(**node_args))
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    c.wait_for_nodes()
    on = lambda node: NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False)  # noqa: E731
    try:
        index = IndexActor.options(name=INDEX_NAME).remote()  # held: an unreferenced actor is reclaimed
        ray.get(index.occupancy.remote())
        size = args.block_kib << 10
        keys = [bytes(k) for k in KeySpace(model="move").chain_hash_ids(list(range(args.blocks)))]
        data = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8) for i in range(args.blocks)]
        pool_a = PeerPoolActor.options(name="kvcluster/a/pool", scheduling_strategy=on(a)).remote(
            "a", args.blocks, size)
        assert all(ray.get(pool_a.put_local.remote(keys, data)))
        cfg = dict(slots=args.blocks, slot_bytes=size)
        dram_a = TierActor.options(name="kvcluster/a/dram", namespace=NAMESPACE, scheduling_strategy=on(a)).remote(
            TierActorConfig.of(node="a", kind="dram", **cfg).model_dump())
        dram_b = TierActor.options(scheduling_strategy=on(b)).remote(TierActorConfig.of(node="b", kind="dram", **cfg).model_dump())
        assert all(ray.get(dram_a.put_many.remote(keys, data)))
        rdma_b = RdmaTierActor.options(scheduling_strategy=on(b)).remote("b", "a", args.blocks * size + (1 << 20),
                                                                          args.blocks)
        mover = Mover.options(scheduling_strategy=on(b)).remote(dram_b)
        blob = Blob.options(scheduling_strategy=on(a)).remote(args.blocks * size)

        @ray.remote(num_cpus=0)
        def read_rdma(actor, ks):
            got = ray.get(actor.get_many.remote(ks))
            return sum(g is not None for g in got)

        read_on_b = read_rdma.options(scheduling_strategy=on(b))
        assert ray.get(read_on_b.remote(rdma_b, keys)) == args.blocks  # warm-up: NIXL metadata exchanged once
        assert ray.get(mover.pull_objects.remote(dram_a, keys)) == args.blocks
        ray.get(mover.pull_raw.remote(blob))
        assert all(ray.get(dram_b.pull.remote("kvcluster/a/dram", keys)))  # warm-up of the tier-to-tier NIXL pull
        moved = args.blocks * size
        t_nixl = best_of(lambda: ray.get(read_on_b.remote(rdma_b, keys)), args.repeat)
        # B must not hold the blocks already (a pull skips what is there): drop them, untimed, before each pull
        t_pull = best_of(lambda: ray.get(dram_b.pull.remote("kvcluster/a/dram", keys)), args.repeat,
                         setup=lambda: ray.get(dram_b.delete.remote(keys)))
        t_obj = best_of(lambda: ray.get(mover.pull_objects.remote(dram_a, keys)), args.repeat)
        t_raw = best_of(lambda: ray.get(mover.pull_raw.remote(blob)), args.repeat)
    finally:
        ray.shutdown()
        c.shutdown()
    gbs = lambda t: moved / t / 1e9  # noqa: E731
    report = {"bytes": moved, "blocks": args.blocks, "nixl_gbps": gbs(t_nixl), "tier_pull_nixl_gbps": gbs(t_pull),
              "object_store_gbps": gbs(t_obj), "raw_ray_object_gbps": gbs(t_raw), "nixl_vs_raw": t_raw / t_nixl,
              "tier_pull_vs_raw": t_raw / t_pull, "object_store_vs_raw": t_raw / t_obj}
    if out.enabled:
        out.emit(report)
        return 0
    print(f"{args.blocks} blocks x {args.block_kib} KiB = {moved / 2**20:.0f} MiB from node A to node B, best of {args.repeat}")
    print("| path | GB/s | vs one raw Ray object |\n|---|---|---|")
    print(f"| NIXL (rdma tier, UCX loopback) | {report['nixl_gbps']:.2f} | {report['nixl_vs_raw']:.2f}x |")
    print(f"| dram tier pull A -> B over NIXL (the control plane's migrations) | {report['tier_pull_nixl_gbps']:.2f} | "
          f"{report['tier_pull_vs_raw']:.2f}x |")
    print(f"| Ray object store (get_many A -> put_many B) | {report['object_store_gbps']:.2f} | {report['object_store_vs_raw']:.2f}x |")
    print(f"| raw: one {moved / 2**20:.0f} MiB numpy array as a Ray object | {report['raw_ray_object_gbps']:.2f} | 1.00x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
