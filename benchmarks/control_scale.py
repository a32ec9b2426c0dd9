"""How much new KV one node ingests through the real store path, and how fast one node controller decides.

Ingest: `--writers` writer actors on one node each store `--requests` requests of
`--blocks` new blocks of the cluster model's size (`configs/cluster/local.yaml`:
128 KiB) through `NodeWriter` (the path replicas and the vLLM connector take:
`prepare_store` on the node's controller, one `put_many` per tier actor it names,
`complete_store`), the controller running `lru` so that every new block is
admitted and both paths write the same bytes (`bayes` may let a new block go at
once, which would flatter the store path). The dram tier holds one trial's blocks
and keys are fresh every trial, so from the second trial on every store also
evicts. The reference, in the same run and interleaved with it, is the same
writers putting the same blocks straight into the node's dram tier actor with
`put_many` (then deleting them; the slab has room for them beside the stored ones). `ingest_vs_direct` is the store path's
throughput over the reference's (goal >= 0.8). The controller's `payload_bytes`
(KV bytes that reached it inside a call's arguments) is `control_payload_bytes`
(goal: 0).

Decisions: one `NodeController` in this process (the object the node's actor
holds) places requests of `--blocks` blocks with `bayes` over a dram tier of
`--decide-capacity` blocks and a nvme tier four times its size, metadata only
(the mover records the moves and the writer's copy is skipped): blocks placed
per second (`decisions_per_s`, goal >= 50,000). `decisions_per_s_actor` is the
same through the node controller actor's remote calls, one request per call pair,
which is what a writer waits for.

Routing: the vLLM app's session placement (`ReplicaSessions.place`, what every
ingress's router asks the deployment's `SessionDirectory` actor once per request)
over `--replicas` replicas, requests of `--blocks` block keys, one in eight of a
new session: requests routed per second in this process (`routes_per_s`) and
through the directory actor, one caller (`routes_per_s_actor`).

    .venv/bin/python benchmarks/control_scale.py [--writers 4] [--requests 40] [--blocks 64] [--trials 3] [--json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from harness import JsonOutput  # noqa: E402

from kvcluster.actors.deploy import start_global_actors, start_tier_actor  # noqa: E402
from kvcluster.actors.index_actor import NAMESPACE  # noqa: E402
from kvcluster.actors.ray_start import start_ray  # noqa: E402
from kvcluster.actors.node_control_actor import NodeControlActor, control_name  # noqa: E402
from kvcluster.actors.tier_actor import TierActorConfig, actor_name  # noqa: E402
from kvcluster.cache_manager import CacheManager  # noqa: E402
from kvcluster.cli import positive_int  # noqa: E402
from kvcluster.cluster_config import load_cluster_config  # noqa: E402
from kvcluster.keys import stand_in_key  # noqa: E402
from kvcluster.node_control import NodeController  # noqa: E402
from kvcluster.policies.base import RequestContext  # noqa: E402
from kvcluster.hierarchy import TierPlan  # noqa: E402
from kvcluster.serve_apps.vllm_router import ReplicaSessions, SessionDirectory  # noqa: E402

NODE = "scale"


@ray.remote(num_cpus=0)
class Writer:
    """One engine's writes: the store path (`NodeWriter`) or straight `put_many` into the dram tier actor."""

    def __init__(self, node: str, block_bytes: int, seed: int) -> None:
        from kvcluster.actors.node_writer import NodeWriter

        self.writer = NodeWriter(node)
        self.dram = ray.get_actor(actor_name(node, "dram"), namespace=NAMESPACE)
        self.payload = np.random.default_rng(seed).integers(0, 255, block_bytes, dtype=np.uint8)
        self.seed = seed

    def run(self, path: str, trial: int, requests: int, blocks: int) -> int:
        """`requests` requests of `blocks` new blocks each, under keys no other call uses; returns blocks landed."""
        landed = 0
        for r in range(requests):
            base = ((trial * 1000 + self.seed) * 10_000 + r) * blocks
            keys = [stand_in_key(base + j) for j in range(blocks)]
            if path == "store":
                landed += self.writer.store(keys, {k: self.payload for k in keys},
                                            RequestContext(index=r, now=float(r), session=f"w{self.seed}"))
            else:
                ok = ray.get(self.dram.put_many.remote(keys, [self.payload] * blocks))
                landed += sum(ok)
                ray.get(self.dram.delete.remote(keys))
        self.writer.flush()
        return landed


def ingest(args, block_bytes: int, tmp: str) -> dict:
    here = ray.get_runtime_context().get_node_id()
    start_global_actors(os.path.join(tmp, "predictor"))
    per_trial = args.writers * args.requests * args.blocks
    in_flight = args.writers * args.blocks  # the reference's puts, each deleted before the writer's next
    dram = start_tier_actor(TierActorConfig.of(node=NODE, kind="dram", slots=per_trial + in_flight,
                                            slot_bytes=block_bytes), here)
    ray.get(dram.describe.remote())
    control = NodeControlActor.options(name=control_name(NODE), namespace=NAMESPACE).remote(
        NODE, [(f"{NODE}/dram", actor_name(NODE, "dram"), per_trial)], "lru", None, block_bytes, 32)
    ray.get(control.stats.remote())
    writers = [Writer.remote(NODE, block_bytes, i) for i in range(args.writers)]
    ray.get([w.run.remote("direct", 0, 1, args.blocks) for w in writers])  # warm: connections, first puts (uncounted)
    seconds: dict[str, list[float]] = {"store": [], "direct": []}
    landed: dict[str, int] = {"store": 0, "direct": 0}
    for trial in range(1, args.trials + 1):
        for path in (("store", "direct") if trial % 2 else ("direct", "store")):
            t0 = time.perf_counter()
            landed[path] += sum(ray.get([w.run.remote(path, trial, args.requests, args.blocks) for w in writers]))
            seconds[path].append(time.perf_counter() - t0)
    stats = ray.get(control.stats.remote())
    nbytes = per_trial * block_bytes
    best = {path: min(s) for path, s in seconds.items()}
    return {"writers": args.writers, "requests_per_writer": args.requests, "blocks_per_request": args.blocks,
            "block_bytes": block_bytes, "trials": args.trials,
            "store_mb_s": round(nbytes / best["store"] / 1e6, 1), "direct_mb_s": round(nbytes / best["direct"] / 1e6, 1),
            "store_blocks_s": round(per_trial / best["store"]), "direct_blocks_s": round(per_trial / best["direct"]),
            "ingest_vs_direct": round(best["direct"] / best["store"], 3),
            "landed": landed, "expected_per_path": per_trial * args.trials, "ingest_policy": "lru",
            "control_payload_bytes": stats["payload_bytes"], "controller": {
                k: stats[k] for k in ("stores", "written", "refused", "moves", "move_failures", "in_flight")},
            "_control": control}


class RecordingMover:
    """Metadata only: the moves a plan asks for are counted, no bytes exist."""

    def __init__(self) -> None:
        self.moves = 0

    def run(self, plan) -> list[bytes]:
        self.moves += len(plan.moves)
        return []

    def delete(self, keys) -> None:
        pass


def decisions(args) -> dict:
    """Blocks placed per second by one `NodeController` (bayes, evicting and demoting), in this process."""
    cap = args.decide_capacity
    manager = CacheManager([TierPlan("dram", cap), TierPlan("nvme", 4 * cap)], "bayes", record_events=False)
    control = NodeController(manager, RecordingMover())
    sessions = 64
    keys = [stand_in_key(i) for i in range(args.decide_requests * args.blocks)]
    placed = 0
    t0 = time.perf_counter()
    for r in range(args.decide_requests):
        session = r % sessions  # a session's next turn shares its previous prefix and adds `blocks` blocks
        prefix = keys[max(0, (r - sessions) * args.blocks): max(0, (r - sessions) * args.blocks)] if r < sessions \
            else keys[(r - sessions) * args.blocks:(r - sessions + 1) * args.blocks]
        new = keys[r * args.blocks:(r + 1) * args.blocks]
        ticket = control.prepare_store(prefix + new, new, RequestContext(index=r, now=float(r), session=f"s{session}"))
        control.complete_store(ticket.plan_id, [])
        placed += len(prefix) + len(new)
    seconds = time.perf_counter() - t0
    return {"decisions_per_s": round(placed / seconds), "decide_requests": args.decide_requests,
            "decide_moves": control.mover.moves, "decide_capacity_blocks": cap}


def decisions_actor(control, args) -> dict:
    """The same decisions through the node controller actor: a prepare and a complete per request."""
    n = max(1, args.decide_requests // 20)
    keys = [stand_in_key(10**9 + i) for i in range(n * args.blocks)]
    t0 = time.perf_counter()
    for r in range(n):
        new = keys[r * args.blocks:(r + 1) * args.blocks]
        plan_id, writes = ray.get(control.prepare_store.remote(new, new, None))
        ray.get(control.complete_store.remote(plan_id, [], new))  # nothing written: every block refused
    seconds = time.perf_counter() - t0
    return {"decisions_per_s_actor": round(n * args.blocks / seconds), "actor_round_trips_per_s": round(n / seconds)}


def route_requests(n: int, blocks: int) -> list[tuple[str, list[bytes]]]:
    """`n` requests of sessions that each come back 8 times, with `blocks` block keys each."""
    return [(f"s{r // 8}", [stand_in_key(r * blocks + b) for b in range(blocks)]) for r in range(n)]


def routing(args) -> dict:
    """Requests placed per second by `ReplicaSessions`, in this process."""
    replicas = [f"replica-{i}" for i in range(args.replicas)]
    sessions, requests = ReplicaSessions(16), route_requests(args.route_requests, args.blocks)
    t0 = time.perf_counter()
    for r, (session, keys) in enumerate(requests):
        sessions.place(replicas, f"q{r}", session, keys, float(r))
    return {"routes_per_s": round(len(requests) / (time.perf_counter() - t0)), "route_replicas": args.replicas}


def routing_actor(args) -> dict:
    """The same through a `SessionDirectory` actor, one caller awaiting each answer (as one ingress request)."""
    replicas = [f"replica-{i}" for i in range(args.replicas)]
    directory = SessionDirectory.remote()
    requests = route_requests(max(1, args.route_requests // 20), args.blocks)
    ray.get(directory.sessions_known.remote())
    t0 = time.perf_counter()
    for r, (session, keys) in enumerate(requests):
        ray.get(directory.place.remote(replicas, f"q{r}", session, keys))
    seconds = time.perf_counter() - t0
    ray.kill(directory)
    return {"routes_per_s_actor": round(len(requests) / seconds)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=positive_int, default=4)
    parser.add_argument("--requests", type=positive_int, default=40, help="requests per writer per trial")
    parser.add_argument("--blocks", type=positive_int, default=64, help="new blocks per request")
    parser.add_argument("--block-bytes", type=positive_int, default=None,
                        help="payload bytes per block (default: the local cluster model's block, 128 KiB)")
    parser.add_argument("--trials", type=positive_int, default=3)
    parser.add_argument("--decide-requests", type=positive_int, default=4000)
    parser.add_argument("--decide-capacity", type=positive_int, default=4096, help="dram blocks for the decisions")
    parser.add_argument("--route-requests", type=positive_int, default=20000, help="requests routed in process")
    parser.add_argument("--replicas", type=positive_int, default=8, help="replicas the requests are routed to")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    out = JsonOutput(args.json)
    block_bytes = args.block_bytes or load_cluster_config("local").block_bytes()
    tmp = tempfile.mkdtemp(prefix="kvcs", dir="/tmp")
    start_ray(lambda: ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=NAMESPACE,
                               _temp_dir=tmp, log_to_driver=False))
    try:
        report = ingest(args, block_bytes, tmp)
        report.update(decisions_actor(report.pop("_control"), args))
        report.update(routing_actor(args))
    finally:
        ray.shutdown()
    report.update(decisions(args))
    report.update(routing(args))
    report["goals"] = {"ingest_vs_direct": 0.8, "control_payload_bytes": 0, "decisions_per_s": 50_000}
    report["meets_goals"] = {"ingest_vs_direct": report["ingest_vs_direct"] >= 0.8,
                             "control_payload_bytes": report["control_payload_bytes"] == 0,
                             "decisions_per_s": report["decisions_per_s"] >= 50_000}
    if args.json:
        out.emit(report)
        return 0
    print(f"ingest, {args.writers} writers x {args.requests} requests x {args.blocks} blocks of {block_bytes} B:")
    print(f"  store path {report['store_mb_s']} MB/s, direct put_many {report['direct_mb_s']} MB/s: "
          f"{report['ingest_vs_direct']}x (goal 0.8)")
    print(f"  KV bytes through control calls: {report['control_payload_bytes']} (goal 0)")
    print(f"decisions: {report['decisions_per_s']:,} blocks/s in one NodeController (goal 50,000); "
          f"{report['decisions_per_s_actor']:,} blocks/s through the actor")
    print(f"routing: {report['routes_per_s']:,} requests/s in process over {args.replicas} replicas; "
          f"{report['routes_per_s_actor']:,}/s through the session directory actor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
