"""What splitting the control plane by key hash costs in hit rate, on every shared trace.

With `control_shards: N` each control plane actor owns the blocks whose key hashes to it and 1/N of every
tier, and its policy sees only its own blocks of each request. This replays each trace of `hit_rate.py`
through the simulator's split (`replay(control_shards=N)`, what a live cluster with N shards hits:
`tests/test_live_replay.py`) against the unsplit hierarchy in the same run, one tier at `--capacity-frac`
of the unique blocks.

    .venv/bin/python benchmarks/control_shards.py [--shards 2,4] [--policies lru,bayes] [--json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import JsonOutput  # noqa: E402
from hit_rate import traces  # noqa: E402

from kvcluster.simulator import TierPlan, prepare, replay  # noqa: E402
from kvcluster.traces import load_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="2,4")
    ap.add_argument("--policies", default="lru,bayes")
    ap.add_argument("--capacity-frac", type=float, default=0.05)
    ap.add_argument("--sharegpt-records", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = JsonOutput(args.json)
    counts = [int(s) for s in args.shards.split(",")]
    rows = []
    for label, path, kwargs in traces(args.sharegpt_records):
        trace = prepare(load_trace(path, **kwargs))
        plan = [TierPlan("dram", max(max(counts), round(args.capacity_frac * trace.unique_blocks)))]
        for policy in args.policies.split(","):
            whole = replay(trace, policy, plan).hit_rate
            split = {n: replay(trace, policy, plan, control_shards=n).hit_rate for n in counts}
            rows.append({"trace": label, "policy": policy, "capacity_blocks": plan[0].capacity_blocks,
                         "one_shard": round(whole, 4), **{f"shards_{n}": round(r, 4) for n, r in split.items()},
                         **{f"shards_{n}_vs_one": round(r / whole, 3) if whole else None for n, r in split.items()}})
    if args.json:
        out.emit({"capacity_frac": args.capacity_frac, "rows": rows})
        return
    head = ["trace", "policy", "blocks", "1 shard"] + [f"{n} shards" for n in counts]
    print(" | ".join(head))
    for r in rows:
        cells = [r["trace"], r["policy"], f"{r['capacity_blocks']:,}", f"{r['one_shard']:.4f}"]
        cells += [f"{r[f'shards_{n}']:.4f} ({r[f'shards_{n}_vs_one']:.3f}x)" for n in counts]
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
