"""The control plane's metadata costs: planning a request with a million blocks tracked, and memory per block.

The cache manager places every committed request; its cost must not grow with
what the cluster holds. This fills a three-tier hierarchy (dram, nvme, pfs) with
`--tracked` blocks (default 1,000,000), then times `prepare_store` for requests of
`--request-blocks` blocks that each miss (so every tier evicts: the worst case),
and, as the same-run reference, the simulator's `Hierarchy.serve` on the same
requests as plain ints (the manager adds byte keys, interning and the net-move
diff). The same run repeats it with a hundredth of the blocks tracked: a plan's cost follows the request,
not what the cluster holds (there is no periodic round over every block). Memory per tracked block is
measured with tracemalloc while filling.

    .venv/bin/python benchmarks/control_plane.py [--policy bayes] [--tracked N] [--json]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import JsonOutput, ratio  # noqa: E402

from kvcluster.cache_manager import CacheManager  # noqa: E402
from kvcluster.policies.base import RequestContext  # noqa: E402
from kvcluster.hierarchy import TierPlan, build_hierarchy  # noqa: E402

GOAL_PLAN_S = 1.0  # planning with a million blocks tracked stays within a second


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def plan(tracked: int) -> list[TierPlan]:
    return [TierPlan("dram", tracked // 10), TierPlan("nvme", tracked * 3 // 10), TierPlan("pfs", tracked * 6 // 10)]


def fill(manager: CacheManager, tracked: int, batch: int) -> float:
    started = time.perf_counter()
    for start in range(0, tracked, batch):
        keys = [key(i) for i in range(start, min(start + batch, tracked))]
        manager.prepare_store(keys, keys, RequestContext(index=start, now=float(start)))
    return time.perf_counter() - started


def measure(policy: str, tracked: int, rb: int, n: int) -> dict:
    """Fill a manager with `tracked` blocks, then time `n` requests of `rb` new blocks against the
    simulator's `Hierarchy.serve` on the same requests (alternating, same moments of the machine)."""
    gc.collect()
    tracemalloc.start()
    manager = CacheManager(plan(tracked), policy)
    fill_s = fill(manager, tracked, 4096)
    bytes_now, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(manager.occupancy().values()) == tracked
    reference = build_hierarchy(policy, plan(tracked))
    for start in range(0, tracked, 4096):
        reference.serve(list(range(start, min(start + 4096, tracked))), RequestContext(index=start, now=float(start)))
    manager_s, reference_s, moves = [], [], 0
    for r in range(n):
        ids = list(range(tracked + r * rb, tracked + (r + 1) * rb))
        ctx = RequestContext(index=tracked + r, now=float(tracked + r))
        keys = [key(i) for i in ids]
        t0 = time.perf_counter()
        store = manager.prepare_store(keys, keys, ctx)
        t1 = time.perf_counter()
        reference.serve(ids, ctx)
        t2 = time.perf_counter()
        manager_s.append(t1 - t0)
        reference_s.append(t2 - t1)
        moves += len(store.moves)
    manager_s.sort()
    reference_s.sort()
    p50 = manager_s[n // 2]
    return {"tracked_blocks": tracked, "moves_per_request": moves / n,
            "plan_s": {"p50": p50, "p99": manager_s[min(n - 1, int(0.99 * n))], "best": manager_s[0]},
            "reference_serve_s": {"p50": reference_s[n // 2], "best": reference_s[0]},
            "manager_vs_reference_p50": ratio(reference_s[n // 2], p50),
            "place_1m_new_blocks_s": p50 * 1_000_000 / rb, "fill_s": fill_s,
            "bytes_per_tracked_block": bytes_now / tracked}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="bayes")
    ap.add_argument("--tracked", type=int, default=1_000_000, help="blocks the hierarchy holds (default 1M)")
    ap.add_argument("--request-blocks", type=int, default=256, help="blocks per timed request (default 256)")
    ap.add_argument("--requests", type=int, default=200, help="timed requests (default 200)")
    ap.add_argument("--json", action="store_true", help="print only JSON on stdout")
    args = ap.parse_args(argv)
    out = JsonOutput(args.json)
    for name in ("tracked", "request_blocks", "requests"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")

    big = measure(args.policy, args.tracked, args.request_blocks, args.requests)
    small = measure(args.policy, max(1000, args.tracked // 100), args.request_blocks, args.requests)
    report = {
        "policy": args.policy, "tracked_blocks": args.tracked, "tiers": [t.__dict__ for t in plan(args.tracked)],
        "request_blocks": args.request_blocks, "requests": args.requests, **big,
        "small": {"tracked_blocks": small["tracked_blocks"], "plan_s": small["plan_s"]},
        "plan_p50_vs_small": ratio(small["plan_s"]["p50"], big["plan_s"]["p50"]),
        "goal": {"plan_s_at_tracked": GOAL_PLAN_S},
    }
    if args.json:
        out.emit(report)
        return 0
    p50, p99 = big["plan_s"]["p50"], big["plan_s"]["p99"]
    print(f"{args.policy}: {args.tracked:,} blocks tracked over dram/nvme/pfs; requests of {args.request_blocks} new "
          f"blocks ({big['moves_per_request']:.0f} moves each)")
    print(f"  plan a request: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms (goal <= {GOAL_PLAN_S:g} s); with "
          f"{small['tracked_blocks']:,} tracked: p50 {small['plan_s']['p50'] * 1e3:.2f} ms "
          f"(x{report['plan_p50_vs_small']:.2f}: no scan of what is tracked)")
    print(f"  the simulator's serve on ints, same requests: p50 {big['reference_serve_s']['p50'] * 1e3:.2f} ms "
          f"(manager x{big['manager_vs_reference_p50']:.2f})")
    print(f"  placing a million new blocks at that rate: {big['place_1m_new_blocks_s']:.1f} s; "
          f"memory {big['bytes_per_tracked_block']:.0f} bytes per tracked block (tracemalloc)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
