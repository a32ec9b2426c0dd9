"""Why host pools thread only large batches: copy, hash and thread-handoff costs, same run.

Measures, for the dram pool, put/get against a numpy copy of the same blocks with
1 and 2 copy threads, plus the three costs that decide the threshold: copying a
batch, the checksum over it (alone, not fused with a copy), and one no-op round trip
through a thread pool.

    .venv/bin/python benchmarks/pool_threads.py [--json] [--repeat 30]
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from harness import JsonOutput, best_of

from kvcluster.cli import positive_int
from kvcluster.keys import KeySpace
from kvcluster.storage import dram_backend
from kvcluster.storage.base import checksum

BLOCK = 2 << 20
BATCHES = [4 << 20, 16 << 20, 64 << 20]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeat", type=positive_int, default=30)
    args = parser.parse_args()
    json_out = JsonOutput(args.json)
    rows = []
    for total in BATCHES:
        n = total // BLOCK
        blocks = [np.random.default_rng(i).integers(0, 255, BLOCK, dtype=np.uint8) for i in range(n)]
        out = [np.empty(BLOCK, dtype=np.uint8) for _ in range(n)]
        keys = KeySpace(model="threads").chain_hash_ids(list(range(n)), cache_salt=str(total))
        items = list(zip(keys, blocks))

        def copy():
            for b, o in zip(blocks, out):
                np.copyto(o, b)

        row = {"batch_bytes": total, "copy_us": best_of(copy, args.repeat) * 1e6,
               "hash_us": best_of(lambda: [checksum(b) for b in blocks], args.repeat) * 1e6}
        for workers in (1, 2):
            pool = dram_backend(n, BLOCK)
            pool._workers.workers = workers
            pool.put_many(items)
            ref = best_of(copy, args.repeat)
            row[f"put_vs_copy_w{workers}"] = ref / best_of(lambda: pool.put_many(items), args.repeat)
            row[f"get_vs_copy_w{workers}"] = ref / best_of(lambda: pool.get_many(keys, out), args.repeat)
        rows.append(row)
    with ThreadPoolExecutor(1) as ex:
        handoff_us = best_of(lambda: ex.submit(lambda: None).result(), args.repeat * 3) * 1e6
    if json_out.enabled:
        json_out.emit({"rows": rows, "thread_handoff_us": handoff_us})
        return 0
    print(f"one no-op thread-pool round trip: {handoff_us:.0f} us")
    print("| batch | copy us | checksum us | put/copy 1 thread | 2 threads | get/copy 1 thread | 2 threads |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_bytes'] >> 20} MiB | {r['copy_us']:.0f} | {r['hash_us']:.0f} | {r['put_vs_copy_w1']:.0%} | "
              f"{r['put_vs_copy_w2']:.0%} | {r['get_vs_copy_w1']:.0%} | {r['get_vs_copy_w2']:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
