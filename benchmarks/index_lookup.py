"""Prefix lookups in the global block index: one actor, N shards, and a replica's local copy.

Every request the ingress routes and every replica fetch asks the index for the
longest held prefix of its block keys. This fills the index with `--blocks` keys
(chains of `--prompt-blocks`, as prompts make them), then times lookups of whole
held prompts three ways, in the same run:

- **plain**: one index actor, one `longest_prefix` call per lookup (the reference);
- **sharded N**: the keys split by hash over N actors, one `locate` call per shard, issued together;
- **local**: a `LocalIndex` copy in this process, refreshed from the shards' journals (no remote call).

Latency is the p50 of lookups made one at a time; throughput is lookups/s with
`--inflight` lookups in flight (asyncio), as an ingress serving many clients makes
them. Ratios are against plain.

    .venv/bin/python benchmarks/index_lookup.py [--blocks 200000] [--shards 1,2,4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from harness import JsonOutput, ratio  # noqa: E402

from kvcluster.actors.index_actor import IndexActor, shard_name  # noqa: E402
from kvcluster.actors.ray_start import start_ray  # noqa: E402
from kvcluster.actors.index_client import IndexClient, LocalIndex  # noqa: E402

REPORT_BATCH = 4096  # keys per `stored` report, as a tier lists what it holds


def prompts(blocks: int, prompt_blocks: int, seed: int = 0) -> list[list[bytes]]:
    rng = np.random.default_rng(seed)
    raw = rng.bytes(32 * blocks)
    keys = [raw[i:i + 32] for i in range(0, len(raw), 32)]
    return [keys[i:i + prompt_blocks] for i in range(0, len(keys), prompt_blocks)]


def start(shards: int, namespace: str) -> tuple[list, IndexClient]:
    actors = [IndexActor.options(name=shard_name(i), namespace=namespace).remote(i, shards) for i in range(shards)]
    ray.get([a.shard_count.remote() for a in actors])
    return actors, IndexClient.connect(namespace=namespace)


def fill(client: IndexClient, chains: list[list[bytes]]) -> None:
    flat = [k for chain in chains for k in chain]
    for i in range(0, len(flat), REPORT_BATCH):
        client.stored("n0" if (i // REPORT_BATCH) % 2 == 0 else "n1", "dram", flat[i:i + REPORT_BATCH])
    deadline = time.monotonic() + 120
    while sum(sum(t.values()) for t in client.occupancy().values()) < len(flat):
        assert time.monotonic() < deadline, "the index never took every report"
        time.sleep(0.05)


def one_at_a_time(index, asked: list[list[bytes]]) -> list[float]:
    out = []
    for keys in asked:
        t0 = time.perf_counter()
        match = index.longest_prefix(keys, timeout_s=30)
        out.append(time.perf_counter() - t0)
        assert match.length == len(keys)
    return out


def in_flight(index, asked: list[list[bytes]], inflight: int) -> float:
    """Seconds for every lookup in `asked` with `inflight` of them outstanding at a time."""

    async def run() -> None:
        queue = iter(asked)

        async def worker() -> None:
            for keys in queue:
                assert (await index.longest_prefix_async(keys)).length == len(keys)

        await asyncio.gather(*(worker() for _ in range(inflight)))

    t0 = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - t0


def measure(name: str, index, asked: list[list[bytes]], inflight: int) -> dict:
    one_at_a_time(index, asked[:50])  # warm: connections, caches
    lat = one_at_a_time(index, asked[: len(asked) // 4])
    seconds = in_flight(index, asked, inflight)
    return {"name": name, "p50_ms": round(statistics.median(lat) * 1e3, 3),
            "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3), "lookups_per_s": round(len(asked) / seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=200_000, help="keys in the index")
    ap.add_argument("--prompt-blocks", type=int, default=32, help="keys per lookup")
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--shards", default="1,2,4", help="shard counts to measure (1 is the plain reference)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = JsonOutput(args.json)
    counts = sorted({int(s) for s in args.shards.split(",")} | {1})
    tmp = tempfile.mkdtemp(prefix="kvidx", dir="/tmp")
    start_ray(lambda: ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
                               _temp_dir=tmp, log_to_driver=False))
    chains = prompts(args.blocks, args.prompt_blocks)
    rng = np.random.default_rng(1)
    asked = [chains[i] for i in rng.integers(0, len(chains), args.lookups)]
    rows = []
    try:
        for n in counts:
            actors, client = start(n, f"kvc-bench-{n}")
            fill(client, chains)
            rows.append(measure("plain" if n == 1 else f"sharded {n}", client, asked, args.inflight))
            if n == counts[-1]:
                local = LocalIndex(client, refresh_s=1.0)
                rows.append(measure(f"local (copy of {n} shards)", local, asked, args.inflight))
                local.close()
            for actor in actors:
                ray.kill(actor)
    finally:
        ray.shutdown()
    plain = rows[0]
    for row in rows:
        row["p50_vs_plain"] = round(ratio(plain["p50_ms"], row["p50_ms"]), 3)  # above 1: faster
        row["throughput_vs_plain"] = round(row["lookups_per_s"] / plain["lookups_per_s"], 3)
    report = {"blocks": args.blocks, "prompt_blocks": args.prompt_blocks, "lookups": args.lookups,
              "inflight": args.inflight, "cpus": os.cpu_count(), "rows": rows}
    if args.json:
        out.emit(report)
        return
    print(f"{args.blocks:,} keys indexed; lookups of {args.prompt_blocks} held keys; {args.inflight} in flight "
          f"for throughput; {os.cpu_count()} CPUs")
    print(f"{'index':<26}{'p50 ms':>9}{'p99 ms':>9}{'lookups/s':>11}{'p50 vs plain':>14}{'tput vs plain':>15}")
    for r in rows:
        print(f"{r['name']:<26}{r['p50_ms']:>9}{r['p99_ms']:>9}{r['lookups_per_s']:>11,}"
              f"{r['p50_vs_plain']:>14}{r['throughput_vs_plain']:>15}")


if __name__ == "__main__":
    main()
