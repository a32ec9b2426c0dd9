"""A replica's fetch of a cached prefix from its node's dram tier actor: NIXL vs the Ray object store.

The replica's `ClusterBlockStore.fetch` with an empty hbm: one index call, then the
dram tier's blocks either over NIXL (one lookup call, one transfer from the tier's
slab into the runner's landing buffers, checksums verified in the replica) or with
`get_many` through the object store. References in the same run: one no-op actor
call, and `get_many` on an in-process dram pool of the same blocks. The two paths
alternate, best and median of `--repeat` each.

    .venv/bin/python benchmarks/replica_fetch.py [--blocks 124] [--block-kib 128] [--repeat 15] [--json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import ray
from harness import Case, JsonOutput, best_of, interleaved

from kvcluster.actors.ray_start import start_ray
from kvcluster.cli import positive_int


@ray.remote(num_cpus=0)
class Noop:
    def ping(self) -> None:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=positive_int, default=124, help="124 x 128 KiB: 1,984 tokens of the default model")
    parser.add_argument("--block-kib", type=positive_int, default=128)
    parser.add_argument("--repeat", type=positive_int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = JsonOutput(args.json)
    tmp = tempfile.mkdtemp(prefix="kvf", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    start_ray(lambda: ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="kvcluster"))
    from kvcluster.actors.deploy import start_global_actors, start_tier_actor
    from kvcluster.actors.tier_actor import TierActorConfig
    from kvcluster.keys import KeySpace
    from kvcluster.serving.block_store import LocalBlockStore
    from kvcluster.storage import dram_backend, hbm_backend
    from kvcluster.storage.tiered import TieredStore
    from kvcluster.serve_apps.cluster_store import ClusterBlockStore

    try:
        start_global_actors(os.path.join(tmp, "predictor"))
        size, n = args.block_kib << 10, args.blocks
        node = ray.get_runtime_context().get_node_id()
        dram = start_tier_actor(TierActorConfig.of(node="n0", kind="dram", slots=2 * n, slot_bytes=size), node)
        keys = KeySpace(model="replica-fetch").chain_hash_ids(list(range(n)))
        data = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8) for i in range(n)]
        assert all(ray.get(dram.put_many.remote([bytes(k) for k in keys], data)))
        landing = np.empty((n, size), dtype=np.uint8)  # the runner's landing buffers (codec.landing)

        def empty_hbm() -> LocalBlockStore:
            return LocalBlockStore(TieredStore([hbm_backend(n + 8, size)], size))

        stores = {"nixl": ClusterBlockStore(empty_hbm(), "n0", nixl_staging_bytes=max(32 << 20, 8 * size)),
                  "object_store": ClusterBlockStore(empty_hbm(), "n0", nixl_staging_bytes=None)}
        deadline = time.monotonic() + 30
        while any(len(s.fetch(keys, list(landing))) < n for s in stores.values()):  # warm: NIXL metadata, index
            assert time.monotonic() < deadline, "the index never listed every block"
            for s in stores.values():
                s.hbm = empty_hbm()
            time.sleep(0.2)

        def fetched(got: list) -> None:
            assert len(got) == n and all(np.array_equal(g, d) for g, d in ((got[0], data[0]), (got[-1], data[-1])))

        def fetch_case(store: ClusterBlockStore) -> Case:
            def setup() -> None:  # every fetch comes from the dram tier, promotion into hbm included
                store.hbm = empty_hbm()
            return Case(lambda: store.fetch(keys, list(landing)), setup, fetched)

        times = interleaved({name: fetch_case(store) for name, store in stores.items()}, args.repeat, rotate=False)
        noop = Noop.remote()
        ray.get(noop.ping.remote())
        noop_s = best_of(lambda: ray.get(noop.ping.remote()), args.repeat)
        pool = dram_backend(n, size)
        pool.put_many(list(zip(keys, data)))
        local_s = best_of(lambda: pool.get_many(keys, list(landing)), args.repeat)
        assert stores["nixl"].counters["nixl_blocks"] >= n * args.repeat
    finally:
        ray.shutdown()
    report = {"blocks": n, "bytes": n * size, "noop_call_ms": noop_s * 1e3, "in_process_get_ms": local_s * 1e3}
    for name, ts in times.items():
        report[f"{name}_best_ms"] = min(ts) * 1e3
        report[f"{name}_p50_ms"] = statistics.median(ts) * 1e3
    report["object_store_over_nixl_p50"] = report["object_store_p50_ms"] / report["nixl_p50_ms"]
    if out.enabled:
        out.emit(report)
        return 0
    print(f"{n} blocks x {args.block_kib} KiB = {n * size / 2**20:.1f} MiB from the node's dram tier actor")
    print("| path | best ms | p50 ms |\n|---|---|---|")
    for name in stores:
        print(f"| {name} | {report[f'{name}_best_ms']:.2f} | {report[f'{name}_p50_ms']:.2f} |")
    print(f"| reference: in-process dram get_many | {report['in_process_get_ms']:.2f} | |")
    print(f"| reference: one no-op actor call | {report['noop_call_ms']:.2f} | |")
    print(f"object store / NIXL at p50: {report['object_store_over_nixl_p50']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
