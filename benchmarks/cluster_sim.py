"""Hit rate over 1, 8 and 64 nodes, with the pooled tier shared and with all capacity split per node.

5% of each trace's unique blocks in all: 1% node-local (split over the nodes,
running the policy) and 4% pooled (one written-through pool shared by all nodes,
running the policy over the uses of every node); `pooled: false` splits the same
5% per node as two node-local tiers. `vs_1_node` is each hit rate over the same machinery's
1-node figure in the same run. The same-run reference is the simulator's one-node
two-tier replay of the same plan (`kvcluster.simulator.replay`), under
`reference`. Goal: pooled `bayes` at 8 and 64 nodes at >= 0.95x its 1-node hit
rate on every trace, and above pooled `lru`.

    .venv/bin/python benchmarks/cluster_sim.py [--json] [--traces claude-code,swe-agent,mooncake]
        [--nodes 1,8,64] [--policies bayes,lru] [--max-requests N] [--fixed-clock] [--clock-seed N]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import JsonOutput  # noqa: E402

from kvcluster.cluster_sim import ClusterPlan, replay_cluster  # noqa: E402
from kvcluster.errors import TraceError  # noqa: E402
from kvcluster.policies.registry import POLICIES  # noqa: E402
from kvcluster.hierarchy import TierPlan  # noqa: E402
from kvcluster.simulator import prepare, replay  # noqa: E402
from kvcluster.traces import load_trace  # noqa: E402

from hit_rate import add_clock_options, clock_from, traces as shared_traces  # noqa: E402

TRACES = ("claude-code", "swe-agent", "mooncake")
NODES = (1, 8, 64)
POLICIES_RUN = ("bayes", "lru")
LOCAL_FRACTION, POOL_FRACTION = 0.01, 0.04
GOAL = 0.95


def plan_for(unique_blocks: int, nodes: int) -> ClusterPlan:
    """1% node-local and 4% pooled; every node gets at least one block of each."""
    local = max(nodes, round(LOCAL_FRACTION * unique_blocks))
    return ClusterPlan((TierPlan("local", local),), TierPlan("pool", max(nodes, round(POOL_FRACTION * unique_blocks))))


def _csv(parser: argparse.ArgumentParser, flag: str, text: str, known: tuple | None = None) -> list[str]:
    items = [x for x in text.split(",") if x]
    if not items:
        parser.error(f"{flag}: give at least one value")
    if known is not None and (bad := [x for x in items if x not in known]):
        parser.error(f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    return items


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the report, as one JSON document, on stdout")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--nodes", default=",".join(map(str, NODES)))
    parser.add_argument("--policies", default=",".join(POLICIES_RUN))
    parser.add_argument("--max-requests", type=int, default=None, help="replay only each trace's first N requests")
    add_clock_options(parser)
    args = parser.parse_args()
    args.traces = _csv(parser, "--traces", args.traces, TRACES)
    online = tuple(name for name, cls in POLICIES.items() if not cls.offline)
    args.policies = _csv(parser, "--policies", args.policies, online)
    try:
        args.nodes = [int(x) for x in _csv(parser, "--nodes", args.nodes)]
    except ValueError:
        parser.error("--nodes: integers, comma-separated")
    if any(n < 1 for n in args.nodes):
        parser.error("--nodes: every count must be >= 1")
    if 1 not in args.nodes:
        args.nodes.insert(0, 1)  # the reference of vs_1_node
    if args.max_requests is not None and args.max_requests < 1:
        parser.error("--max-requests must be >= 1")
    return args


def load(label: str, path: str, kwargs: dict, max_requests: int | None):
    prepared = prepare(load_trace(path, **kwargs))
    if max_requests is not None:
        cut = prepared.blocks[:max_requests]
        prepared = dataclasses.replace(
            prepared, blocks=cut, types=prepared.types[:max_requests],
            transitions=prepared.transitions[:max_requests], arrivals=prepared.arrivals[:max_requests],
            input_tokens=prepared.input_tokens[:max_requests], sessions=prepared.sessions[:max_requests],
            unique_blocks=len({b for blocks in cut for b in blocks}),
            finishes=prepared.finishes[:max_requests], output_tokens=prepared.output_tokens[:max_requests])
    return prepared


def run_trace(label: str, prepared, args, say) -> tuple[list[dict], list[dict]]:
    rows, refs = [], []
    for policy in args.policies:
        one = plan_for(prepared.unique_blocks, 1)
        ref = replay(prepared, policy, list(one.local) + [one.pool]).hit_rate
        refs.append({"trace": label, "policy": policy, "simulator_two_tier_hit_rate": ref})
        base: dict[bool, float] = {}
        for nodes in args.nodes:
            plan = plan_for(prepared.unique_blocks, nodes)
            for pooled in (True, False):
                r = replay_cluster(prepared, policy, plan, nodes, pooled=pooled)
                if nodes == 1:
                    base[pooled] = r.hit_rate
                ratio = r.hit_rate / base[pooled] if base[pooled] else None
                rows.append({"trace": label, "nodes": nodes, "policy": policy, "pooled": pooled,
                             "hit_rate": round(r.hit_rate, 4), "local_share": round(r.local_share, 4),
                             "vs_1_node": None if ratio is None else round(ratio, 3),
                             "seconds": round(r.seconds, 1)})
                say(rows[-1], ref)
    return rows, refs


def main() -> int:
    args = parse_args()
    out = JsonOutput(args.json)
    paths = {label: (path, kwargs) for label, path, kwargs in shared_traces(1, clock_from(args))}
    if not args.json:
        print("| trace | nodes | policy | pooled | hit rate | vs 1 node | local share | 1-node two-tier replay |")
        print("|---|---|---|---|---|---|---|---|")

    def say(row: dict, ref: float) -> None:
        if not args.json:
            ratio = "n/a" if row["vs_1_node"] is None else f"{row['vs_1_node']:.3f}x"
            print(f"| {row['trace']} | {row['nodes']} | {row['policy']} | {row['pooled']} | {row['hit_rate']:.4f} | "
                  f"{ratio} | {row['local_share']:.3f} | {ref:.4f} |", flush=True)

    results, references = [], []
    for label in args.traces:
        path, kwargs = paths[label]
        t0 = time.perf_counter()
        try:
            prepared = load(label, path, kwargs, args.max_requests)
        except TraceError as err:
            print(f"cluster_sim: {err}", file=sys.stderr)
            return 2
        print(f"<!-- {label}: {prepared.requests} requests, {prepared.unique_blocks} unique blocks, loaded in "
              f"{time.perf_counter() - t0:.1f} s -->", file=sys.stderr)
        rows, refs = run_trace(label, prepared, args, say)
        results += rows
        references += refs
    if args.json:
        out.emit({"results": results, "reference": references, "goal": goal(results)})
    return 0


def goal(results: list[dict]) -> dict:
    """Pooled `bayes` beyond one node at >= GOAL x its 1-node figure, and above pooled `lru` where both ran."""
    pooled = {(r["trace"], r["nodes"], r["policy"]): r for r in results if r["pooled"]}
    scaled = [r for (_, nodes, policy), r in pooled.items() if policy == "bayes" and nodes > 1]
    keeps = all(r["vs_1_node"] is not None and r["vs_1_node"] >= GOAL for r in scaled)
    above = all(r["hit_rate"] > pooled[(r["trace"], r["nodes"], "lru")]["hit_rate"]
                for r in scaled if (r["trace"], r["nodes"], "lru") in pooled)
    return {"vs_1_node": GOAL, "keeps_vs_1_node": keeps, "above_lru": above, "met": bool(scaled) and keeps and above}


if __name__ == "__main__":
    sys.exit(main())
