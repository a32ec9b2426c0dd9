"""The fixed per-request path, replica -> index -> tier fetch: plain actor calls vs a Compiled Graph.

Two real actors hold the library objects the live system uses (a BlockIndex and
a dram pool). Per request the replica (this driver) asks the index for the
longest prefix of its keys and fetches that run from the tier in one batch.
Plain: two `.remote()` + `ray.get` round trips per request. Compiled: the same two
methods bound into a Ray Compiled Graph (index -> tier on the same input), one
`execute` per request. Reported as requests/s and per-request latency, and the
compiled/plain ratio; a bare no-op actor call is the reference for Ray's floor.

    .venv/bin/python benchmarks/actor_path.py [--requests 300] [--blocks 8] [--block-kib 128] [--json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_CGRAPH_buffer_size_bytes", str(64 << 20))
os.environ.setdefault("RAY_CGRAPH_teardown_timeout", "5")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from harness import JsonOutput, timings  # noqa: E402
from ray.dag import InputNode  # noqa: E402

from kvcluster.actors.ray_start import start_ray  # noqa: E402
from kvcluster.block_index import BlockIndex  # noqa: E402
from kvcluster.keys import KeySpace  # noqa: E402
from kvcluster.storage import dram_backend  # noqa: E402


@ray.remote(num_cpus=0)
class Index:
    def __init__(self, keys: list[bytes]) -> None:
        self.index = BlockIndex()
        self.index.stored("n0", "dram", keys)

    def lookup(self, keys: list[bytes]) -> list[bytes]:
        return list(keys[: self.index.longest_prefix(keys).length])

    def noop(self, x):
        return x


@ray.remote(num_cpus=0)
class Tier:
    def __init__(self, keys: list[bytes], block_bytes: int) -> None:
        self.backend = dram_backend(len(keys), block_bytes)
        rng = np.random.default_rng(0)
        self.backend.put_many([(k, rng.integers(0, 255, block_bytes, dtype=np.uint8)) for k in keys])

    def fetch(self, keys: list[bytes]) -> np.ndarray:
        got = self.backend.get_many(keys)
        return np.concatenate([g for g in got if g is not None]) if keys else np.empty(0, np.uint8)


def summary(lat: list[float]) -> dict:
    return {"req_per_s": len(lat) / sum(lat), "p50_ms": 1e3 * statistics.median(lat),
            "p99_ms": 1e3 * sorted(lat)[int(0.99 * (len(lat) - 1))]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=8, help="keys per request (all cached)")
    parser.add_argument("--block-kib", type=int, default=128, help="payload per block (128 KiB: tiny-llama, 16 tokens)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = JsonOutput(args.json)
    tmp = tempfile.mkdtemp(prefix="kvb", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    start_ray(lambda: ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=512 << 20,
                               _temp_dir=tmp, log_to_driver=False))
    keys = [bytes(k) for k in KeySpace(model="bench").chain_hash_ids(list(range(args.blocks)))]
    index, tier = Index.remote(keys), Tier.remote(keys, args.block_kib << 10)
    expect = ray.get(tier.fetch.remote(keys)).nbytes

    def plain() -> None:
        run = ray.get(index.lookup.remote(keys))
        assert ray.get(tier.fetch.remote(run)).nbytes == expect

    with InputNode() as inp:
        dag = tier.fetch.bind(index.lookup.bind(inp))
    compiled = dag.experimental_compile()

    def cgraph() -> None:
        assert ray.get(compiled.execute(keys)).nbytes == expect

    noop = lambda: ray.get(index.noop.remote(1))  # noqa: E731
    for fn in (plain, cgraph, noop):  # warm up
        timings(fn, 20)
    results = {"plain": summary(timings(plain, args.requests)), "compiled": summary(timings(cgraph, args.requests)),
               "noop_call": summary(timings(noop, args.requests))}
    compiled.teardown()
    ray.shutdown()
    ratio = results["compiled"]["req_per_s"] / results["plain"]["req_per_s"]
    report = {"requests": args.requests, "blocks": args.blocks, "bytes_per_request": expect, **results,
              "compiled_vs_plain": ratio}
    if out.enabled:
        out.emit(report)
        return 0
    print(f"{args.requests} requests, {args.blocks} blocks x {args.block_kib} KiB = {expect / 2**20:.1f} MiB each")
    print("| path | req/s | p50 ms | p99 ms |\n|---|---|---|---|")
    for name in ("plain", "compiled", "noop_call"):
        r = results[name]
        print(f"| {name} | {r['req_per_s']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    print(f"compiled / plain: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
