"""The control plane's move round over real tier actors: plain calls per round vs one Ray Compiled Graph.

Plain is what a node's controller runs: `RemoteMover` (`actors/plan_mover.py`),
three rounds per plan (read at the source tier actors, delete, write into the
destination tier actors), each round one `.remote()` per tier actor; the reads'
results stay in the object store and go to the writers as references, so the
payloads never enter the controller.
Compiled binds the same move into one graph per node: every tier actor reads and
deletes its part (`read_verified`, `delete`), then every tier actor writes its
part (`put_many`) from the other tiers' reads, so the payloads go tier to tier
and a plan is one `execute`. Both run the actors' own methods (through
`__ray_call__`), so index reports and metrics are the same.

A round moves `--blocks` blocks one tier down a ring of tiers (the last tier's
group goes back to the first): with dram,nvme that is 32 blocks demoted dram ->
nvme, then promoted back the next round; with dram,nvme,pfs two groups move per
round. Plain and compiled rounds alternate on the same actors (`interleaved`), and
every block's bytes are checked at the end.

`--coexist` then asks, on fresh tier actors, what Ray allows around such a graph,
since the tier actors have other callers (replicas' reads, NIXL lookups, a restarted
control plane's `held_keys`, a second control plane shard's own graph): whether a
plain call is served while a graph task runs on the same actor (and on which
thread), whether replica reads during graph rounds see wrong bytes, what a tier
actor restart does to the graph, and whether a second graph, or the graph of a
control plane that replaced a dead one, runs over the same actors. It adds about
four minutes (each compile takes seconds on a small machine).

    .venv/bin/python benchmarks/move_round.py [--rounds 60] [--blocks 32] [--block-kib 64] [--coexist] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_CGRAPH_buffer_size_bytes", str(32 << 20))  # above a round's largest payload
os.environ.setdefault("RAY_CGRAPH_teardown_timeout", "5")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from harness import JsonOutput, interleaved  # noqa: E402
from ray.dag import InputNode, MultiOutputNode  # noqa: E402

from kvcluster.actors.deploy import start_tier_actor  # noqa: E402
from kvcluster.actors.index_actor import INDEX_NAME, NAMESPACE, IndexActor  # noqa: E402
from kvcluster.actors.ray_start import start_ray  # noqa: E402
from kvcluster.actors.plan_mover import RemoteMover  # noqa: E402
from kvcluster.actors.tier_actor import TierActorConfig, actor_name  # noqa: E402
from kvcluster.cache_manager import Move, StorePlan  # noqa: E402
from kvcluster.cli import positive_int  # noqa: E402
from kvcluster.keys import KeySpace  # noqa: E402
from kvcluster.plan_executor import execute  # noqa: E402

CALL_TIMEOUT_S = 120.0
VARIANTS = {"2-tier": ("dram", "nvme"), "3-tier": ("dram", "nvme", "pfs")}


# ---- run inside the tier actors, through __ray_call__ -------------------------------------------------------

def read_and_delete(actor, op: tuple[list[bytes], list[bytes]]):
    """Stage 1 on one tier: read what leaves it for another tier, then drop everything that leaves it."""
    reads, deletes = op
    payloads, digests = actor.read_verified(reads) if reads else ([], [])
    if deletes:
        actor.delete(deletes)
    return reads, payloads, digests


def write_from(actor, keys: list[bytes], *sources) -> list[bool]:
    """Stage 2 on one tier: store `keys`, taking each payload from whichever tier read it; a key no tier
    could read is refused (False), as `execute` reports it."""
    found = {k: (p, d) for ks, ps, ds in sources for k, p, d in zip(ks, ps, ds) if p is not None}
    here = [i for i, k in enumerate(keys) if k in found]
    ok = [False] * len(keys)
    if here:
        stored = actor.put_many([keys[i] for i in here], [found[keys[i]][0] for i in here], None, False,
                                [found[keys[i]][1] for i in here])
        for i, good in zip(here, stored):
            ok[i] = good
    return ok


class CompiledMove:
    """One node's tier actors bound into one graph: a plan (no held bytes) is one `execute`."""

    def __init__(self, actors: list) -> None:
        self.n = len(actors)
        with InputNode() as inp:
            reads = [a.__ray_call__.bind(read_and_delete, inp[t]) for t, a in enumerate(actors)]
            writes = [a.__ray_call__.bind(write_from, inp[self.n + t], *reads) for t, a in enumerate(actors)]
            self.dag = MultiOutputNode(writes).experimental_compile()

    def run(self, plan: StorePlan, timeout: float = CALL_TIMEOUT_S) -> list[bytes]:
        reads, deletes, writes = plan.by_source(), plan.deletes(), plan.writes()
        ops = [(reads.get(t, []), deletes.get(t, [])) for t in range(self.n)]
        keys = [[m.key for m in writes.get(t, [])] for t in range(self.n)]
        oks = ray.get(self.dag.execute(*ops, *keys), timeout=timeout)
        return [k for ks, ok in zip(keys, oks) for k, good in zip(ks, ok) if not good]

    def teardown(self) -> None:
        self.dag.teardown()


# ---- can the graph share its tier actors with their other callers? -----------------------------------------

def busy(actor, seconds: float):
    """A graph task that holds its actor's graph thread for `seconds`."""
    t0 = time.time()
    time.sleep(seconds)
    return t0, time.time(), threading.get_ident()


def answering(actors) -> None:
    """Wait until every actor answers: one restarting refuses calls (ActorUnavailableError) until it is back."""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    for actor in actors:
        while True:
            try:
                ray.get(actor.describe.remote(), timeout=CALL_TIMEOUT_S)
                break
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def where(actor):
    return time.time(), threading.get_ident()


@ray.remote(num_cpus=0)
class Replica:
    """Another caller of a tier actor while the graph runs: a replica's batched reads and a restart's listing."""

    def read_loop(self, tier, keys: list[bytes], payload: dict, seconds: float) -> dict:
        out = {"batches": 0, "found": 0, "wrong_bytes": 0, "errors": 0}
        end = time.time() + seconds
        while time.time() < end:
            try:
                got = ray.get(tier.get_many.remote(keys), timeout=CALL_TIMEOUT_S)
                ray.get(tier.held_keys.remote(), timeout=CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError):
                out["errors"] += 1
                continue
            out["batches"] += 1
            out["found"] += sum(p is not None for p in got)
            out["wrong_bytes"] += sum(p is not None and not np.array_equal(p, payload[k]) for k, p in zip(keys, got))
        return out


@ray.remote(num_cpus=0)
class Compiler:
    """A control plane stand-in: compiles the graph in its own process and runs one plan (then is killed)."""

    def run(self, actors: list, plan: StorePlan) -> int:
        self.move = CompiledMove(actors)
        return len(self.move.run(plan))


def fresh(node: str, tier_names, block_bytes: int, slots: int, root: str, here: str, keys, payload):
    """Tier actors for one probe (a graph left on an actor spoils it for the next), the keys in the first."""
    actors = [start_tier_actor(TierActorConfig.of(node=node, kind=t, slots=slots, slot_bytes=block_bytes,
                                               path=None if t in ("dram", "cxl") else f"{root}/{node}-{t}"), here)
              for t in tier_names]
    ray.get([a.describe.remote() for a in actors], timeout=CALL_TIMEOUT_S)
    assert all(ray.get(actors[0].put_many.remote(keys, [payload[k] for k in keys]), timeout=CALL_TIMEOUT_S))
    return actors


def attempt(fn, timeout_note: str) -> dict:
    t0 = time.perf_counter()
    try:
        value = fn()
        return {"ok": True, "value": value, "seconds": round(time.perf_counter() - t0, 2)}
    except (ray.exceptions.RayError, TimeoutError) as exc:
        return {"ok": False, "error": type(exc).__name__, "seconds": round(time.perf_counter() - t0, 2),
                "note": timeout_note}


def coexist(args, root: str, here: str) -> dict:
    """What Ray allows around a compiled graph on the tier actors, each answer measured on real TierActors."""
    block_bytes = args.block_kib << 10
    keys = [bytes(k) for k in KeySpace(model="move-round-coexist").chain_hash_ids(list(range(args.blocks)))]
    rng = np.random.default_rng(11)
    payload = {k: rng.integers(0, 255, block_bytes, dtype=np.uint8) for k in keys}
    report: dict = {}
    tiers = ("dram", "nvme")
    actors = fresh("co-a", tiers, block_bytes, args.blocks, root, here, keys, payload)
    # 1. a normal call while a graph task is busy on the same actor: served at once, on another thread
    with InputNode() as inp:
        dag = actors[0].__ray_call__.bind(busy, inp).experimental_compile()
    ref = dag.execute(1.0)
    time.sleep(0.2)
    t0 = time.perf_counter()
    at, thread = ray.get(actors[0].__ray_call__.remote(where), timeout=CALL_TIMEOUT_S)
    answered = time.perf_counter() - t0
    start, end, graph_thread = ray.get(ref, timeout=CALL_TIMEOUT_S)
    dag.teardown()
    report["normal_call_during_graph_task"] = {"answered_ms": round(1e3 * answered, 1),
                                               "while_graph_task_ran": start < at < end,
                                               "same_thread": thread == graph_thread}
    # 2. a replica reading the source tier while graph rounds move the same blocks
    ring, move = Ring([keys], len(tiers)), CompiledMove(actors)
    reads = Replica.remote().read_loop.remote(actors[0], keys, payload, args.stress_s)
    rounds, failed, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < args.stress_s:
        rounds += 1
        failed += len(move.run(ring.next_plan(rounds)))
    got = ray.get(actors[ring.at[0]].get_many.remote(keys), timeout=CALL_TIMEOUT_S)
    report["replica_reads_during_graph_rounds"] = {
        "graph_rounds": rounds, "graph_failed_blocks": failed, **ray.get(reads, timeout=CALL_TIMEOUT_S),
        "corrupt_reads": ray.get(actors[0].stats.remote(), timeout=CALL_TIMEOUT_S)["corrupt"],
        "final_bytes_right": sum(p is not None and np.array_equal(p, payload[k]) for k, p in zip(keys, got))}
    # 3. a tier actor restarts: the next round raises (no hang), the graph is torn down and compiled again
    ray.kill(actors[1], no_restart=False)
    after_kill = attempt(lambda: len(move.run(ring.next_plan(10**6), timeout=30)), "graph round after the kill")
    t0 = time.perf_counter()
    move.teardown()
    teardown_s = time.perf_counter() - t0
    answering(actors)
    for a in actors:  # start again from a known place: everything in dram
        ray.get(a.delete.remote(list(keys)), timeout=CALL_TIMEOUT_S)
    ray.get(actors[0].put_many.remote(keys, [payload[k] for k in keys]), timeout=CALL_TIMEOUT_S)
    ring = Ring([keys], len(tiers))
    recompile = attempt(lambda: CompiledMove(actors), "compile over the restarted actor")
    move = recompile.pop("value", None)
    first = attempt(lambda: len(move.run(ring.next_plan(1), timeout=30)), "first round") if move else {}
    report["tier_actor_restart"] = {"round_after_kill": after_kill, "teardown_s": round(teardown_s, 2),
                                    "recompile": recompile, "first_round_failed_blocks": first}
    # 4. a second graph over the same actors (a second control plane shard shares every tier actor)
    second = attempt(lambda: CompiledMove(actors), "compile a second graph")
    other = second.pop("value", None)
    second_run = attempt(lambda: len(other.run(ring.next_plan(2), timeout=args.probe_timeout_s)),
                         f"no answer within {args.probe_timeout_s} s") if other else {}
    report["second_graph_on_same_actors"] = {"compile": second, "round": second_run}
    for a in actors:  # first: a second graph's teardown waits on its actors for ever while they live
        ray.kill(a, no_restart=True)
    for dag in (other, move):
        if dag is not None:
            attempt(dag.teardown, "teardown")
    # 5. the compiling process dies (a control plane restart); its successor compiles over the same actors
    actors = fresh("co-b", tiers, block_bytes, args.blocks, root, here, keys, payload)
    ring = Ring([keys], len(tiers))
    compiler = Compiler.remote()
    first = attempt(lambda: ray.get(compiler.run.remote(actors, ring.next_plan(1)), timeout=CALL_TIMEOUT_S),
                    "graph compiled inside an actor")
    ray.kill(compiler, no_restart=True)
    successor = attempt(lambda: CompiledMove(actors), "compile after the compiling process died")
    move = successor.pop("value", None)
    round_ = attempt(lambda: len(move.run(ring.next_plan(2), timeout=args.probe_timeout_s)),
                     f"no answer within {args.probe_timeout_s} s") if move else {}
    for a in actors:
        ray.kill(a, no_restart=True)
    if move is not None:
        attempt(move.teardown, "teardown")
    report["compiling_process_died"] = {"first_compiler_failed_blocks": first, "successor_compile": successor,
                                        "successor_round_failed_blocks": round_}
    return report


# ---- the benchmark ------------------------------------------------------------------------------------------

class Ring:
    """Where each group of blocks is: every round moves each group one tier down the ring."""

    def __init__(self, groups: list[list[bytes]], tiers: int) -> None:
        self.groups, self.tiers = groups, tiers
        self.at = list(range(len(groups)))  # group g starts in tier g

    def next_plan(self, plan_id: int) -> StorePlan:
        moves = tuple(Move(k, self.at[g], (self.at[g] + 1) % self.tiers)
                      for g, keys in enumerate(self.groups) for k in keys)
        self.at = [(t + 1) % self.tiers for t in self.at]
        return StorePlan(plan_id, moves)


def summary(seconds: list[float], moves: int) -> dict:
    return {"rounds_per_s": round(len(seconds) / sum(seconds), 1),
            "p50_ms": round(1e3 * statistics.median(seconds), 3),
            "p99_ms": round(1e3 * sorted(seconds)[int(0.99 * (len(seconds) - 1))], 3),
            "blocks_per_round": moves}


def measure(name: str, tier_names: tuple[str, ...], args, root: str, here: str) -> dict:
    block_bytes = args.block_kib << 10
    groups_n = len(tier_names) - 1
    slots = groups_n * args.blocks
    node = f"mr-{name}"
    actors = [start_tier_actor(TierActorConfig.of(node=node, kind=t, slots=slots, slot_bytes=block_bytes,
                                               path=None if t in ("dram", "cxl") else f"{root}/{t}"), here)
              for t in tier_names]
    ray.get([a.describe.remote() for a in actors], timeout=CALL_TIMEOUT_S)
    mover = RemoteMover(actors, [actor_name(node, t) for t in tier_names])
    space = KeySpace(model=f"move-round-{name}")
    groups = [[bytes(k) for k in space.chain_hash_ids(list(range(g * 10_000, g * 10_000 + args.blocks)))]
              for g in range(groups_n)]
    rng = np.random.default_rng(7)
    payload = {k: rng.integers(0, 255, block_bytes, dtype=np.uint8) for ks in groups for k in ks}
    for g, keys in enumerate(groups):  # group g starts in tier g
        assert all(ray.get(actors[g].put_many.remote(keys, [payload[k] for k in keys]), timeout=CALL_TIMEOUT_S))
    ring = Ring(groups, len(tier_names))
    t0 = time.perf_counter()
    compiled = CompiledMove(actors)
    compile_s = time.perf_counter() - t0
    plan_ids = iter(range(1, 1 << 30))
    failed: list[bytes] = []
    cases = {"plain": lambda: failed.extend(mover.run(ring.next_plan(next(plan_ids)))),
             "compiled": lambda: failed.extend(compiled.run(ring.next_plan(next(plan_ids))))}
    interleaved(cases, args.warmup)
    seconds = interleaved(cases, args.rounds)
    compiled.teardown()
    assert not failed, f"{len(failed)} blocks did not reach their tier"
    for g, keys in enumerate(groups):  # every block's bytes where the ring says it is
        got = ray.get(actors[ring.at[g]].get_many.remote(keys), timeout=CALL_TIMEOUT_S)
        assert all(p is not None and np.array_equal(p, payload[k]) for k, p in zip(keys, got)), f"{name}: wrong bytes"
    for a in actors:
        ray.kill(a, no_restart=True)
    moves = groups_n * args.blocks
    plain, comp = summary(seconds["plain"], moves), summary(seconds["compiled"], moves)
    return {"tiers": list(tier_names), "block_kib": args.block_kib, "compile_s": round(compile_s, 2),
            "plain": plain, "compiled": comp,
            "compiled_vs_plain": round(comp["rounds_per_s"] / plain["rounds_per_s"], 3),
            "compiled_vs_plain_p50": round(plain["p50_ms"] / comp["p50_ms"], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=60, help="timed rounds of each path per variant")
    parser.add_argument("--warmup", type=positive_int, default=5)
    parser.add_argument("--blocks", type=positive_int, default=32, help="blocks per group (one group per hop)")
    parser.add_argument("--block-kib", type=positive_int, default=64)
    parser.add_argument("--coexist", action="store_true",
                        help="also probe what Ray allows around the graph: other callers, restarts, a second graph")
    parser.add_argument("--stress-s", type=float, default=5.0, help="--coexist: seconds of replica reads")
    parser.add_argument("--probe-timeout-s", type=float, default=5.0, help="--coexist: a round that hangs")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"--variants: choose among {', '.join(VARIANTS)}")
    out = JsonOutput(args.json)
    tmp = tempfile.mkdtemp(prefix="kvm", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    start_ray(lambda: ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
                               _temp_dir=tmp, log_to_driver=False, namespace=NAMESPACE))
    try:
        index = IndexActor.options(name=INDEX_NAME).remote()  # held: tier actors report to it
        here = ray.get_runtime_context().get_node_id()
        report = {name: measure(name, VARIANTS[name], args, tmp, here) for name in variants}
        probes = coexist(args, tmp, here) if args.coexist else None
        ray.kill(index, no_restart=True)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    goal = "keep the faster one"
    kept = "compiled" if all(r["compiled_vs_plain"] > 1 for r in report.values()) else "plain"
    report = {"rounds": args.rounds, "goal": goal, "faster": kept, "variants": report,
              **({"coexist": probes} if probes is not None else {})}
    if out.enabled:
        out.emit(report)
        return 0
    print(f"{args.rounds} rounds per path, {args.blocks} blocks x {args.block_kib} KiB per hop, alternating")
    print("| variant | path | blocks/round | rounds/s | p50 ms | p99 ms |\n|---|---|---|---|---|---|")
    for name, r in report["variants"].items():
        for path in ("plain", "compiled"):
            s = r[path]
            print(f"| {name} | {path} | {s['blocks_per_round']} | {s['rounds_per_s']} | {s['p50_ms']} | {s['p99_ms']} |")
    for name, r in report["variants"].items():
        print(f"{name}: compiled / plain {r['compiled_vs_plain']:.2f}x rounds/s, {r['compiled_vs_plain_p50']:.2f}x p50 "
              f"(compiling the graph took {r['compile_s']} s)")
    if probes is not None:
        print(json.dumps({"coexist": probes}, indent=1))
    print(f"goal: {goal} -> {kept} is faster on every variant" if kept == "compiled" else
          f"goal: {goal} -> compiled is not faster on every variant")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
