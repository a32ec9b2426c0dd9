"""What a checksummed copy costs against a plain copy of the same bytes, same run.

Per batch of 2 MiB blocks (smaller batches: one block): numpy copy (the reference),
the tiers' fused copy+checksum (`copyhash.copy_hash`), a copy followed by a separate
checksum pass, and a copy followed by xxh3-64 (what the tiers did before). Also
`pread_hash` against a plain `preadv` of the same page-cached file. Best of
`--repeat`, the variants run in turn each round.

    .venv/bin/python benchmarks/checksum_kernel.py [--json] [--repeat 50]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import xxhash
from harness import JsonOutput, best_interleaved

from kvcluster.cli import positive_int
from kvcluster.storage import copyhash

BLOCK = 2 << 20
BATCHES = [256 << 10, 1 << 20, 4 << 20, 16 << 20]


def copy_variants(src: list[np.ndarray], dst: list[np.ndarray]) -> dict:
    def pairs(step):
        return lambda: [step(d, s) for s, d in zip(src, dst)]
    return {
        "copy": pairs(np.copyto),
        "fused": pairs(copyhash.copy_hash),
        "copy_then_sum": pairs(lambda d, s: (np.copyto(d, s), copyhash.hash_bytes(d))),
        "copy_then_xxh3": pairs(lambda d, s: (np.copyto(d, s), xxhash.xxh3_64_intdigest(d))),
    }


def read_variants(paths: list[str], dst: list[np.ndarray]) -> dict:
    def each(step):
        def run():
            for path, d in zip(paths, dst):
                fd = os.open(path, os.O_RDONLY)
                try:
                    step(fd, d)
                finally:
                    os.close(fd)
        return run
    return {"preadv": each(lambda fd, d: os.preadv(fd, [d], 0)),
            "pread_hash": each(lambda fd, d: copyhash.pread_hash(fd, d, 0))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeat", type=positive_int, default=50)
    args = parser.parse_args()
    out = JsonOutput(args.json)
    rows, tmp = [], tempfile.mkdtemp(prefix="kvc-sum-")
    for total in BATCHES:
        block = min(total, BLOCK)
        src = [np.random.default_rng(i).integers(0, 256, block, dtype=np.uint8) for i in range(total // block)]
        dst = [np.empty(block, dtype=np.uint8) for _ in src]
        paths = []
        for i, s in enumerate(src):
            paths.append(os.path.join(tmp, f"b{total}-{i}"))
            with open(paths[-1], "wb") as f:
                f.write(s.tobytes())
        # the same order every round, as every figure of this kernel so far was measured
        t = best_interleaved({**copy_variants(src, dst), **read_variants(paths, dst)}, args.repeat, rotate=False)
        rows.append({"batch_bytes": total, "copy_us": t["copy"] * 1e6,
                     **{f"{k}_vs_copy": t["copy"] / t[k] for k in ("fused", "copy_then_sum", "copy_then_xxh3")},
                     "preadv_us": t["preadv"] * 1e6, "pread_hash_vs_preadv": t["preadv"] / t["pread_hash"]})
    if out.enabled:
        out.emit({"kernel": copyhash.KERNEL, "rows": rows})
        return 0
    print(f"checksum kernel: {copyhash.KERNEL}")
    print("| batch | copy us | fused copy+sum / copy | copy, then sum | copy, then xxh3 | preadv us | pread_hash / preadv |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_bytes'] >> 10:,} KiB | {r['copy_us']:.0f} | {r['fused_vs_copy']:.0%} | "
              f"{r['copy_then_sum_vs_copy']:.0%} | {r['copy_then_xxh3_vs_copy']:.0%} | {r['preadv_us']:.0f} | "
              f"{r['pread_hash_vs_preadv']:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
