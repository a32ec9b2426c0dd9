"""Replay speed in block refs/s for each policy, against LRU in the same run.

Goal: >= 1M refs/s for LRU and >= 0.5x of LRU's speed for `bayes`.

    .venv/bin/python benchmarks/replay_speed.py [--repeat 3] [--fraction 0.05]
"""

from __future__ import annotations

import argparse
import sys

from kvcluster.paths import shared_data_dir
from kvcluster.policies.registry import policy_names
from kvcluster.simulator import TierPlan, prepare, replay
from kvcluster.traces import load_trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per policy; the best is kept")
    parser.add_argument("--fraction", type=float, default=0.05, help="capacity as a fraction of unique blocks")
    args = parser.parse_args()
    prepared = prepare(load_trace(str(shared_data_dir() / "mooncake" / "synthetic_trace.jsonl")))
    cap = round(args.fraction * prepared.unique_blocks)
    speeds = {}
    for policy in policy_names():
        speeds[policy] = max(replay(prepared, policy, [TierPlan("hbm", cap)]).refs_per_s for _ in range(args.repeat))
    print(f"mooncake, {prepared.block_refs:,} refs, capacity {cap:,} blocks, best of {args.repeat}")
    print("| policy | refs/s | vs LRU |")
    print("|---|---|---|")
    for policy, speed in speeds.items():
        print(f"| {policy} | {speed:,.0f} | {speed / speeds['lru']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
