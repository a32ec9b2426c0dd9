"""Memory of the control plane's bookkeeping as new blocks keep coming: bounded by the tiers, not the keys met.

A live cache manager meets keys without end. This replays the Mooncake trace
through a `CacheManager` (the control plane's, no Ray: its memory is the point)
pass after pass, each pass under fresh keys, sessions and later times, so that
every pass brings as many new blocks as the whole trace. After each pass it
reports the keys the manager tracks, the sessions its policy remembers and the
Python heap it holds (tracemalloc), against a reference in the same run that
forgets nothing (every key met, every ghost, every session: the manager as it
was before its memory was bounded). Goal: the heap after the last pass is under
twice the heap after the first, while the reference's grows with the keys met.

    .venv/bin/python benchmarks/control_memory.py [--passes 6] [--policy bayes] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from dataclasses import replace

from harness import JsonOutput
from hit_rate import load

from kvcluster.cache_manager import MIN_KEYS_SWEPT, CacheManager
from kvcluster.paths import shared_data_dir
from kvcluster.policies.registry import POLICIES
from kvcluster.hierarchy import TierPlan
from kvcluster.simulator import prepare, request_context


FORGET_NOTHING = {"bayes": {"ghost_factor": 1e12, "max_sessions": 1 << 62}}  # policy options of the reference


def run(trace, plan: list[TierPlan], policy: str, passes: int, options: dict, keys_swept_from: int) -> list[dict]:
    """Replay `passes` passes under fresh keys through one manager; what it holds after each."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    manager = CacheManager(plan, policy, policy_options=options or None, keys_swept_from=keys_swept_from)
    span = trace.arrivals[-1] - trace.arrivals[0] + 1.0
    rows = []
    for p in range(passes):
        salt = p.to_bytes(4, "little")
        for i, blocks in enumerate(trace.blocks):
            keys = [salt + b.to_bytes(8, "little") for b in blocks]
            ctx = replace(request_context(trace, i), now=trace.arrivals[i] + p * span,
                          session=f"{p}/{trace.sessions[i]}")
            manager.prepare_store(keys, keys, ctx)
        rows.append({"pass": p + 1, "keys_met": trace.unique_blocks * (p + 1), "keys_tracked": manager.tracked(),
                     "sessions": manager.sessions_known(),
                     "heap_mib": (tracemalloc.get_traced_memory()[0] - base) / 2**20})
    tracemalloc.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=6, help="passes over the trace, each under fresh keys")
    online = [name for name, cls in POLICIES.items() if not cls.offline]
    parser.add_argument("--policy", default="bayes", choices=online, help="the control plane's eviction policy")
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    parser.add_argument("--smoke", action="store_true", help="a tiny slice of the trace: checks the code runs")
    args = parser.parse_args()
    if args.passes < 2:
        parser.error("--passes must be >= 2 (the last pass is compared with the first)")
    out = JsonOutput(args.json)
    path = shared_data_dir() / "mooncake" / "synthetic_trace.jsonl"
    if not path.exists():
        print(f"control_memory: trace not found: {path}", file=sys.stderr)
        return 2
    trace = prepare(load(str(path), args.smoke))
    unique = trace.unique_blocks
    plan = [TierPlan("dram", unique // 50), TierPlan("nvme", unique // 20), TierPlan("pfs", unique // 10)]
    bounded = run(trace, plan, args.policy, args.passes, {}, MIN_KEYS_SWEPT)
    unbounded = run(trace, plan, args.policy, args.passes, FORGET_NOTHING.get(args.policy, {}), 1 << 62)
    first, last = bounded[0]["heap_mib"], bounded[-1]["heap_mib"]
    result = {"trace": "mooncake", "policy": args.policy, "capacities": [t.capacity_blocks for t in plan],
              "bounded": bounded, "forgets_nothing": unbounded,
              "last_vs_first": last / first, "vs_reference_last": last / unbounded[-1]["heap_mib"],
              "goal_met": last < 2 * first}
    if args.json:
        out.emit(result)
        return 0
    print(f"mooncake through one CacheManager ({args.policy}), tiers {result['capacities']} blocks, "
          f"{args.passes} passes under fresh keys; cells: bounded / forgets nothing")
    print("| pass | keys met | keys tracked | sessions | heap MiB | heap vs reference |")
    print("|---|---|---|---|---|---|")
    for b, u in zip(bounded, unbounded):
        print(f"| {b['pass']} | {b['keys_met']:,} | {b['keys_tracked']:,} / {u['keys_tracked']:,} "
              f"| {b['sessions']:,} / {u['sessions']:,} | {b['heap_mib']:.1f} / {u['heap_mib']:.1f} "
              f"| {b['heap_mib'] / u['heap_mib']:.2f}x |")
    print(f"heap after the last pass: {result['last_vs_first']:.2f}x the first's (goal < 2x: "
          f"{'met' if result['goal_met'] else 'not met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
