"""One engine, two drivers: a trace through real tier actors and a node's controller hits what the simulator
replays, per tier, on bytes read back from the tiers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from kvcluster.actors.live_replay import block_key, block_payload, replay_live  # noqa: E402
from kvcluster.hierarchy import TierPlan  # noqa: E402
from kvcluster.simulator import prepare, replay  # noqa: E402
from kvcluster.traces import load_trace  # noqa: E402

from data_support import require_data  # noqa: E402

ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def own_ray():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def mooncake():
    return require_data("mooncake", "synthetic_trace.jsonl")


@pytest.fixture(scope="module")
def trace(mooncake):
    return prepare(load_trace(str(mooncake), max_records=150))


@pytest.mark.parametrize("policy", ["lru", "bayes", "arc"])
def test_live_and_simulated_hit_rates_are_equal_per_tier(own_ray, trace, policy: str) -> None:
    caps = [trace.unique_blocks // 50, trace.unique_blocks // 25, trace.unique_blocks // 10]
    out = replay_live(trace, policy, "local", caps)
    live, simulated = out["live"], out["simulated"]
    assert out["wrong_bytes"] == 0 and out["control_payload_bytes"] == 0  # bytes went writer -> tier, tier -> tier
    assert [t["hits"] for t in live["tiers"]] == [t["hits"] for t in simulated["tiers"]]
    assert live["prefix_hits"] == simulated["prefix_hits"] > 0
    assert [t["evictions"] for t in live["tiers"]] == [t["evictions"] for t in simulated["tiers"]]
    assert out["max_abs_diff"] == 0.0
    assert [t["name"] for t in live["tiers"]] == ["n0/dram", "n0/nvme", "n0/pfs"]


def test_queued_requests_are_prefetched_live_as_in_the_simulator(own_ray, trace) -> None:
    """The control plane's prefetch of queued requests (the next second of arrivals) runs the simulator's
    Prefetcher: the same blocks lifted, the same prefetch hits and waste, the same hits per tier."""
    caps = [trace.unique_blocks // 50, trace.unique_blocks // 25, trace.unique_blocks // 10]
    out = replay_live(trace, "lru", "local", caps, prefetch_lead_s=1.0)
    live, simulated = out["live"], out["simulated"]
    assert out["wrong_bytes"] == 0 and out["max_abs_diff"] == 0.0
    assert [t["hits"] for t in live["tiers"]] == [t["hits"] for t in simulated["tiers"]]
    assert live["prefetch"] == simulated["prefetch"] and live["prefetch"]["issued"] > 0
    assert live["prefetch"]["hits"] > 0
    # without prefetch, as the simulator replays it (live equals it: the per-tier test above)
    plain = replay(trace, "lru", [TierPlan(t["name"], t["capacity_blocks"]) for t in simulated["tiers"]])
    assert live["tiers"][0]["hits"] > plain.tiers[0]["hits"]  # hits moved up to the first tier


def test_answers_told_to_the_control_plane_after_each_request_hit_what_the_simulator_says(own_ray, trace) -> None:
    """As vLLM's connector tells them: each request stored without its answer, which reaches the node's
    controller after it; live equals `replay(answers_at_finish=True)`, per tier."""
    caps = [trace.unique_blocks // 50, trace.unique_blocks // 25, trace.unique_blocks // 10]
    out = replay_live(trace, "bayes", "local", caps, answers_at_finish=True)
    live, simulated = out["live"], out["simulated"]
    assert out["wrong_bytes"] == 0 and out["max_abs_diff"] == 0.0
    assert [t["hits"] for t in live["tiers"]] == [t["hits"] for t in simulated["tiers"]]
    assert [t["evictions"] for t in live["tiers"]] == [t["evictions"] for t in simulated["tiers"]]
    assert live["prefix_hits"] > 0


def test_stand_in_bytes_differ_for_every_block() -> None:
    a, b = block_payload(block_key(1), 4096), block_payload(block_key(2), 4096)
    assert a.nbytes == 4096 and (a != b).any() and (block_payload(block_key(1), 4096) == a).all()


def test_the_cli_prints_the_simulators_json_with_the_live_figures(mooncake) -> None:
    run = subprocess.run([sys.executable, "-m", "kvcluster.cli", "replay", str(mooncake), "--live", "--policy", "lru",
                          "--tier-blocks", "40,80,200", "--max-records", "60", "--json"],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["driver"] == "live" and out["wrong_bytes"] == 0 and out["max_abs_diff"] == 0.0
    live, sim = out["results"][0], out["simulated"][0]
    assert set(sim) <= set(live) | {"projected_ttft_s", "throughput"}
    assert live["capacity_blocks"] == 320 and live["per_tier"] == sim["per_tier"]


@pytest.mark.parametrize("argv, message", [
    (["--policy", "belady", "--tier-blocks", "1,1,1"], "offline policy"),
    (["--policy", "lru", "--tier-blocks", "1,1"], "--tier-blocks: give one value per tier of node n0 "
                                                  "(n0/dram, n0/nvme, n0/pfs), fastest first; got 2"),
    (["--policy", "lru", "--tier-fracs", "0.1"], "--tier-fracs: give one value per tier of node n0"),
    (["--policy", "lru", "--tiers", "h100-node"], "--tiers is a simulator option"),
    (["--policy", "lru", "--tier-fracs", "0,0.1,0.2"], "--tier-fracs values must be in (0, 1]"),
    # --capacity-* always sweep capacities: never read as the live tiers' split
    (["--policy", "lru", "--capacity-frac", "0.02,0.05,0.1"], "--capacity-frac sweeps the capacity of the "
                                                             "simulator's single tier"),
    (["--policy", "lru", "--capacity-blocks", "4"], "--capacity-blocks sweeps"),
])
def test_bad_live_options_are_refused_by_name(mooncake, argv, message: str, capsys) -> None:
    """In this process: each is refused before anything starts (the CLI as a process: the test above)."""
    from kvcluster.cli import main

    try:
        code = main(["replay", str(mooncake), "--live", "--max-records", "5", *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err[-2000:]


def test_a_dead_tier_actor_fails_its_part_of_a_plan_without_stopping_the_rest(own_ray) -> None:
    """A round that raised halfway would leave tiers and bookkeeping apart: moves into a dead tier fail (their
    keys are reported), the others land, and deleting on it raises nothing."""
    import numpy as np

    from kvcluster.actors.deploy import start_tier_actor
    from kvcluster.actors.index_actor import INDEX_NAME, NAMESPACE, IndexActor
    from kvcluster.actors.plan_mover import RemoteMover
    from kvcluster.actors.tier_actor import TierActorConfig
    from kvcluster.cache_manager import Move, StorePlan

    index = IndexActor.options(name=INDEX_NAME, namespace=NAMESPACE).remote()
    here = ray.get_runtime_context().get_node_id()
    src, alive, dead = (start_tier_actor(TierActorConfig.of(node=n, kind="dram", slots=4, slot_bytes=4096), here)
                        for n in ("io-s", "io-a", "io-b"))
    mover = RemoteMover([src, alive, dead], ["kvcluster/io-s/dram", "kvcluster/io-a/dram", "kvcluster/io-b/dram"],
                        timeout_s=30)
    ray.get([a.describe.remote() for a in (src, alive, dead)])
    ray.kill(dead, no_restart=True)  # asynchronous: wait until the actor answers no more
    deadline = time.monotonic() + 300
    while True:
        try:
            ray.get(dead.describe.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break
        assert time.monotonic() < deadline, "the killed tier actor still answers"
        time.sleep(0.1)
    a, b = block_key(1), block_key(2)
    assert ray.get(src.put_many.remote([a, b], [block_payload(a, 4096), block_payload(b, 4096)])) == [True, True]
    failed = mover.run(StorePlan(1, (Move(a, 0, 1), Move(b, 0, 2))))
    assert failed == [b]  # b's destination is gone: reported, never claimed
    assert np.array_equal(ray.get(alive.get_many.remote([a]))[0], block_payload(a, 4096))
    assert ray.get(src.get_many.remote([a, b])) == [None, None]  # both left their source (the plan said so)
    mover.delete({1: [a], 2: [b]})  # no exception from the dead one
    assert ray.get(alive.get_many.remote([a])) == [None]
    for actor in (src, alive, index):
        ray.kill(actor, no_restart=True)
