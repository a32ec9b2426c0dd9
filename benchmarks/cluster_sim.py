"""Hit rate over 1, 8 and 64 nodes, with the pooled tier shared and with all capacity split per node.

5% of each trace's unique blocks in all: 1% node-local (split over the nodes,
running the policy) and 4% pooled (one written-through pool shared by all nodes,
running the policy over the uses of every node); `pooled: false` splits the same
5% per node as two node-local tiers. `vs_1_node` is each hit rate over the same machinery's
1-node figure in the same run, and `vs_one_cache` over one cache holding the same 5% as one
tier with the same policy (the pool is the nodes' memory: that is what it should match). The
same-run references are the simulator's one-node two-tier replay of the same plan
(`kvcluster.simulator.replay`) and that one cache, under `reference`. Goal: pooled `bayes` at 8 and 64 nodes at >= 0.95x its 1-node hit
rate on every trace, and above pooled `lru`.

`--pool-shards 1,4,16`: pooled rows for the pool split by key hash over that many
managers (`kvcluster.pool.ShardedPool`, each with its share of the capacity and a
policy of its own), against one manager (1), to measure what the split costs.

`--live`: the pool live instead (`kvcluster.actors.live_cluster_replay`), on
`--live-nodes` Ray nodes of a `ray.cluster_utils.Cluster` on this machine: the
first `--live-records` ShareGPT conversations, the same 1% + 4% plan, a
shared-directory pool; the live hit rate and local share beside the simulator's,
the bytes that read back wrong, and the pool manager's decisions per second (the
`PoolManager` in this process, and its actor: one caller waiting for each
answer, and `--live-in-flight` calls in flight).

    .venv/bin/python benchmarks/cluster_sim.py [--json] [--traces claude-code,swe-agent,mooncake]
        [--nodes 1,8,64] [--policies bayes,lru] [--max-requests N] [--pool-shards 1,4,16] [--fixed-clock]
        [--clock-seed N]
    .venv/bin/python benchmarks/cluster_sim.py --live [--json] [--policies bayes,lru] [--live-nodes 4] [--live-pool dram]
        [--live-records 40] [--live-in-flight 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
ONE_CACHE_GOAL = 0.97  # pooled bayes against one cache of the same total memory, at 8 and 64 nodes


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


def _counts(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """Comma-separated integers >= 1 (a CLI error naming the flag otherwise)."""
    try:
        counts = [int(x) for x in _csv(parser, flag, text)]
    except ValueError:
        parser.error(f"{flag}: integers, comma-separated")
    if any(n < 1 for n in counts):
        parser.error(f"{flag}: every count must be >= 1")
    return counts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the report, as one JSON document, on stdout")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--nodes", default=",".join(map(str, NODES)))
    parser.add_argument("--policies", default=",".join(POLICIES_RUN))
    parser.add_argument("--max-requests", type=int, default=None, help="replay only each trace's first N requests")
    parser.add_argument("--pool-shards", default="1", help="comma-separated: the pool split by key hash over this "
                        "many managers (rows per count; 1: one manager), to measure what the split costs")
    parser.add_argument("--live", action="store_true", help="replay live on a local multi-node Ray cluster")
    parser.add_argument("--live-nodes", type=int, default=4)
    parser.add_argument("--live-pool", choices=("pfs", "dram"), default="pfs",
                        help="the live pool's storage: one shared directory, or DRAM each node lends (read over NIXL)")
    parser.add_argument("--live-records", type=int, default=40, help="ShareGPT conversations replayed live")
    parser.add_argument("--live-in-flight", type=int, default=8, help="pool manager calls in flight (its rate)")
    add_clock_options(parser)
    args = parser.parse_args()
    if min(args.live_nodes, args.live_records, args.live_in_flight) < 1:
        parser.error("--live-nodes, --live-records and --live-in-flight must be >= 1")
    args.traces = _csv(parser, "--traces", args.traces, TRACES)
    online = tuple(name for name, cls in POLICIES.items() if not cls.offline)
    args.policies = _csv(parser, "--policies", args.policies, online)
    args.nodes = _counts(parser, "--nodes", args.nodes)
    if 1 not in args.nodes:
        args.nodes.insert(0, 1)  # the reference of vs_1_node
    args.pool_shards = _counts(parser, "--pool-shards", args.pool_shards)
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
        total = sum(t.capacity_blocks for t in one.local) + one.pool.capacity_blocks
        one_cache = replay(prepared, policy, [TierPlan("one-cache", total)]).hit_rate
        refs.append({"trace": label, "policy": policy, "simulator_two_tier_hit_rate": ref,
                     "one_cache_hit_rate": round(one_cache, 4)})
        base: dict[bool, float] = {}
        for nodes in args.nodes:
            plan = plan_for(prepared.unique_blocks, nodes)
            for pooled, shards in [(True, n) for n in args.pool_shards] + [(False, 1)]:
                r = replay_cluster(prepared, policy, plan, nodes, pooled=pooled, pool_shards=shards)
                if nodes == 1 and shards == 1:
                    base[pooled] = r.hit_rate
                ratio = r.hit_rate / base[pooled] if base.get(pooled) else None
                rows.append({"trace": label, "nodes": nodes, "policy": policy, "pooled": pooled,
                             "pool_shards": shards if pooled else 0,
                             "hit_rate": round(r.hit_rate, 4), "local_share": round(r.local_share, 4),
                             "vs_1_node": None if ratio is None else round(ratio, 3),
                             "vs_one_cache": round(r.hit_rate / one_cache, 3) if one_cache else None,
                             "seconds": round(r.seconds, 1)})
                say(rows[-1], ref)
    return rows, refs


def main() -> int:
    args = parse_args()
    out = JsonOutput(args.json)
    if args.live:
        return live(args, out)
    paths = {label: (path, kwargs) for label, path, kwargs in shared_traces(1, clock_from(args))}
    if not args.json:
        print("| trace | nodes | policy | pooled | pool shards | hit rate | vs 1 node | vs one cache | local share | "
              "1-node two-tier replay |")
        print("|---|---|---|---|---|---|---|---|---|---|")

    def say(row: dict, ref: float) -> None:
        if not args.json:
            ratio = "n/a" if row["vs_1_node"] is None else f"{row['vs_1_node']:.3f}x"
            print(f"| {row['trace']} | {row['nodes']} | {row['policy']} | {row['pooled']} | {row['pool_shards']} | "
                  f"{row['hit_rate']:.4f} | "
                  f"{ratio} | {row['vs_one_cache']}x | {row['local_share']:.3f} | {ref:.4f} |", flush=True)

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


def live(args, out: JsonOutput) -> int:
    """The pool live on `--live-nodes` Ray nodes against the simulator, and the pool manager's rate."""
    import os
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    from kvcluster.actors.index_actor import NAMESPACE
    from kvcluster.actors.live_cluster_replay import replay_cluster_live
    from kvcluster.actors.ray_start import start_ray

    path, kwargs = {label: (p, kw) for label, p, kw in shared_traces(args.live_records, clock_from(args))}["sharegpt"]
    prepared = prepare(load_trace(path, **kwargs))
    plan = plan_for(prepared.unique_blocks, args.live_nodes)
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="kvc", dir="/tmp")  # short socket paths, a Ray of its own
    node_args = {"num_cpus": 1, "object_store_memory": 96 << 20}
    cluster = start_ray(lambda: Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False}))
    workers = [start_ray(lambda: cluster.add_node(**node_args)) for _ in range(args.live_nodes - 1)]
    rows = []
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        cluster.wait_for_nodes()
        ray_nodes = [ray.get_runtime_context().get_node_id()] + [w.node_id for w in workers]
        for policy in args.policies:
            r = replay_cluster_live(prepared, policy, plan, ray_nodes, pool_storage=args.live_pool)
            lv, sim = r["live"], r["simulated"]
            rows.append({"trace": f"sharegpt[:{args.live_records}]", "nodes": args.live_nodes, "policy": policy,
                         "requests": prepared.requests, "block_refs": prepared.block_refs,
                         "local_blocks": plan.local[0].capacity_blocks, "pool_blocks": plan.pool.capacity_blocks,
                         "live_hit_rate": round(lv["hit_rate"], 4), "simulated_hit_rate": round(sim["hit_rate"], 4),
                         "live_local_share": round(lv["local_share"], 4),
                         "simulated_local_share": round(sim["local_share"], 4), "max_abs_diff": r["max_abs_diff"],
                         "wrong_bytes": r["wrong_bytes"], "control_payload_bytes": r["control_payload_bytes"],
                         "pool_payload_bytes": r["pool_payload_bytes"], "pool_calls": r["pool"]["calls"],
                         "pool_storage": args.live_pool, "pool_reads": r["pool_reads"],
                         "live_seconds": round(lv["seconds"], 1)})
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
        rate = pool_rate(prepared, args.policies[0], plan.pool.capacity_blocks, args.live_in_flight)
    finally:
        ray.shutdown()
        cluster.shutdown()
    if not args.json:
        print(json.dumps(rate))
    else:
        out.emit({"live": rows, "pool_manager": rate,
                  "equal": all(r["max_abs_diff"] == 0.0 and r["wrong_bytes"] == 0 for r in rows)})
    return 0


def pool_rate(prepared, policy: str, capacity: int, in_flight: int, seconds: float = 2.0) -> dict:
    """Decisions per second of the pool manager over the trace's requests (repeated for `seconds`): one
    lookup + access per request, in this process and through its actor."""
    import ray

    from kvcluster.actors.live_replay import block_key
    from kvcluster.actors.pool_manager_actor import PoolManagerActor
    from kvcluster.policies.base import RequestContext
    from kvcluster.pool import PoolManager

    keys = [[block_key(b) for b in blocks] for blocks in prepared.blocks]
    per_request = sum(map(len, keys)) / len(keys)

    def timed(serve) -> float:
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            done += serve(done)
        return done / (time.perf_counter() - t0)

    pool = PoolManager(policy, capacity)

    def here(i: int) -> int:
        for j, ks in enumerate(keys):
            ctx = RequestContext(i + j, float(i + j))
            pool.lookup(ks)
            pool.access(ks, ctx, "pfs")
        return len(keys)

    actor = PoolManagerActor.remote(policy, capacity)

    def one_caller(i: int) -> int:
        for j, ks in enumerate(keys):
            ray.get(actor.lookup_access.remote(ks, RequestContext(i + j, float(i + j)), "pfs"))
        return len(keys)

    def pipelined(i: int) -> int:
        refs = []
        for j, ks in enumerate(keys):
            refs.append(actor.lookup_access.remote(ks, RequestContext(i + j, float(i + j)), "pfs"))
            if len(refs) >= in_flight:
                ray.get(refs.pop(0))
        ray.get(refs)
        return len(keys)

    rates = {"in_process": timed(here), "actor_one_caller": timed(one_caller), "actor_in_flight": timed(pipelined)}
    ray.kill(actor)
    return {"policy": policy, "capacity_blocks": capacity, "blocks_per_request": round(per_request, 1),
            "in_flight": in_flight, **{f"{k}_requests_per_s": round(v) for k, v in rates.items()},
            **{f"{k}_blocks_per_s": round(v * per_request) for k, v in rates.items()}}


def goal(results: list[dict]) -> dict:
    """Pooled `bayes` beyond one node at >= GOAL x its 1-node figure, and above pooled `lru` where both ran; and,
    reported beside it, at >= ONE_CACHE_GOAL x one cache of the same total memory (one tier, the same policy):
    the reference a pool that *is* the nodes' memory is measured against."""
    pooled = {(r["trace"], r["nodes"], r["policy"]): r for r in results if r["pooled"] and r["pool_shards"] <= 1}
    scaled = [r for (_, nodes, policy), r in pooled.items() if policy == "bayes" and nodes > 1]
    keeps = all(r["vs_1_node"] is not None and r["vs_1_node"] >= GOAL for r in scaled)
    above = all(r["hit_rate"] > pooled[(r["trace"], r["nodes"], "lru")]["hit_rate"]
                for r in scaled if (r["trace"], r["nodes"], "lru") in pooled)
    one_cache = all(r["vs_one_cache"] is not None and r["vs_one_cache"] >= ONE_CACHE_GOAL for r in scaled)
    return {"vs_1_node": GOAL, "keeps_vs_1_node": keeps, "above_lru": above, "met": bool(scaled) and keeps and above,
            "vs_one_cache": ONE_CACHE_GOAL, "keeps_vs_one_cache": bool(scaled) and one_cache}


if __name__ == "__main__":
    sys.exit(main())
