"""Replay speed in block refs/s for each policy, against LRU in the same run.

Goal: >= 1M refs/s for LRU and >= 0.5x of LRU's speed for `bayes`.

    .venv/bin/python benchmarks/replay_speed.py [--repeat 5] [--fraction 0.05] [--json]
"""

from __future__ import annotations

import argparse
import sys

from harness import JsonOutput

from kvcluster.paths import shared_data_dir
from kvcluster.policies.registry import policy_names
from kvcluster.hierarchy import TierPlan
from kvcluster.simulator import prepare, replay
from kvcluster.traces import load_trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="rounds of runs of every policy; each keeps its best")
    parser.add_argument("--fraction", type=float, default=0.05, help="capacity as a fraction of unique blocks")
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    args = parser.parse_args()
    out = JsonOutput(args.json)
    prepared = prepare(load_trace(str(shared_data_dir() / "mooncake" / "synthetic_trace.jsonl")))
    cap = round(args.fraction * prepared.unique_blocks)
    speeds = dict.fromkeys(policy_names(), 0.0)
    for _ in range(args.repeat):  # rounds over all policies, so that the machine's drift hits each alike
        for policy in speeds:
            speeds[policy] = max(speeds[policy], replay(prepared, policy, [TierPlan("hbm", cap)]).refs_per_s)
    if args.json:
        out.emit({"trace": "mooncake", "block_refs": prepared.block_refs, "capacity_blocks": cap,
                  "repeat": args.repeat, "refs_per_s": speeds,
                  "vs_lru": {p: s / speeds["lru"] for p, s in speeds.items()},
                  "goal_lru_met": speeds["lru"] >= 1e6, "goal_bayes_met": speeds["bayes"] >= 0.5 * speeds["lru"]})
        return 0
    print(f"mooncake, {prepared.block_refs:,} refs, capacity {cap:,} blocks, best of {args.repeat}")
    print("| policy | refs/s | vs LRU |")
    print("|---|---|---|")
    for policy, speed in speeds.items():
        print(f"| {policy} | {speed:,.0f} | {speed / speeds['lru']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
