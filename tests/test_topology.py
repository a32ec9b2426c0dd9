"""One topology config: the tier kinds defined once, and one cluster file feeding the live cluster's layout,
the simulator and the cost model; bad input names its field."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from kvcluster.cli import main
from kvcluster.cluster_config import load_cluster_config
from kvcluster.cluster_control import node_chains
from kvcluster.cost_model import make_cost_model
from kvcluster.errors import ConfigError
from kvcluster.model_spec import load_model_spec
from kvcluster.replay import ReplayOptions, run_replay, topology_plan
from kvcluster.simulator import prepare
from kvcluster.sizing import size_model
from kvcluster.tiers import (DURABLE_TIERS, KINDS, NIXL_TIERS, NODE_TIERS, TIER_ORDER, load_node_tiers)
from kvcluster.traces import load_trace

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = str(Path(__file__).parent / "fixtures" / "traces" / "bailian.jsonl")


def cluster_dict(tmp_path: Path) -> dict:
    """One node: dram with its own figures, nvme and pfs on the kinds' defaults, a GPU for the cost model."""
    return {
        "model": "kvcluster-tiny-llama", "block_tokens": 16, "checkpoint_dir": str(tmp_path / "ckpt"),
        "nodes": [{"name": "n0", "gpu": {"name": "g", "count": 2, "dense_bf16_tflops": 4.0, "mfu": 0.25},
                   "tiers": [{"kind": "pfs", "capacity": f"{4 * 131072}B", "path": str(tmp_path / "pfs")},
                             {"kind": "dram", "capacity": f"{2 * 131072}B", "read_gbps": 4, "write_gbps": 2,
                              "latency_us": 7},
                             {"kind": "nvme", "capacity": f"{3 * 131072}B", "path": str(tmp_path / "nvme")}]}],
    }


def write(tmp_path: Path, data: dict, name: str = "cluster.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_tier_sets_are_derived_from_the_one_kind_table() -> None:
    from kvcluster.actors.peer_server import MEMORY_TIERS
    from kvcluster.actors.tier_actor import TierActorConfig
    from kvcluster.serve_apps.cluster_store import NIXL_TIERS as STORE_NIXL

    assert TIER_ORDER == ("hbm", "dram", "cxl", "nvme", "rdma", "pfs")
    assert NIXL_TIERS == ("dram", "cxl") and MEMORY_TIERS == ("dram", "cxl") and STORE_NIXL == ("dram", "cxl")
    assert DURABLE_TIERS == ("nvme", "pfs")
    assert NODE_TIERS == ("dram", "cxl", "nvme", "pfs")
    for tier in NODE_TIERS:
        path = "/tmp/x" if tier in DURABLE_TIERS else None
        assert TierActorConfig.of(node="n", kind=tier, slots=1, slot_bytes=1, path=path).kind == tier
    for tier in ("hbm", "rdma"):
        with pytest.raises(ValueError, match="tier"):
            TierActorConfig.of(node="n", kind=tier, slots=1, slot_bytes=1)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import tier_bandwidth
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert tier_bandwidth.BACKENDS == ("hbm", "dram", "cxl", "nvme", "rdma", "pfs")


def test_left_out_figures_are_the_kind_s_and_given_ones_win(tmp_path) -> None:
    node = load_cluster_config(write(tmp_path, cluster_dict(tmp_path))).node()
    assert [t.kind for t in node.tiers] == ["dram", "nvme", "pfs"]  # kept fastest first
    dram, nvme, _ = node.tiers
    assert (dram.read_gbps, dram.write_gbps, dram.latency_us, dram.medium) == (4, 2, 7, "host memory pool")
    assert (nvme.read_gbps, nvme.write_gbps, nvme.latency_us) == (2, 1, 100)
    laptop = load_node_tiers("laptop-cpu")  # writes capacities only
    assert [(t.kind, t.read_gbps, t.write_gbps, t.latency_us) for t in laptop.tiers] == [
        (k.name, k.read_gbps, k.write_gbps, k.latency_us) for k in KINDS.values()]


def test_one_cluster_file_feeds_the_actors_the_simulator_and_the_cost_model(tmp_path) -> None:
    path = write(tmp_path, cluster_dict(tmp_path))
    cfg = load_cluster_config(path)
    # the live side: tier actors' slots and the control plane's chain
    assert cfg.block_bytes() == 131072
    chain = node_chains(cfg)["n0"]
    assert [(t.label, t.capacity_blocks) for t in chain] == [("n0/dram", 2), ("n0/nvme", 3), ("n0/pfs", 4)]
    # the simulator: the same hierarchy, in blocks of the trace's bytes
    assert topology_plan(cfg, cfg.block_bytes()) == [t.plan() for t in chain]
    trace = prepare(load_trace(FIXTURE))
    report = run_replay(ReplayOptions(policies=("lru",), topology=path), trace)
    assert report["model"] == "kvcluster-tiny-llama" and report["topology"] == {"cluster": path, "node": "n0"}
    block_bytes = size_model(load_model_spec(cfg.model)).bytes_per_token * trace.block_size
    expected = [(t.label, t.tier.usable_bytes // block_bytes) for t in chain]
    assert [(t["name"], t["capacity_blocks"]) for t in report["results"][0]["tiers"]] == expected
    assert report["results"][0]["projected_ttft_s"]["mean"] > 0
    # the cost model: this file's dram figures and GPUs
    spec = load_model_spec(cfg.model)
    cost = make_cost_model(spec, size_model(spec), cfg.node(), ("n0/dram", "n0/nvme"), block_size=16)
    assert cost.compute_flops_per_s == 2 * 4.0e12 * 0.25
    dram_only = cost.ttft([3, 0], 48) - cost.ttft([0, 0], 0)
    assert dram_only == pytest.approx(7e-6 + 3 * 131072 / 4e9)


@pytest.mark.parametrize("change, field", [
    (lambda d: d["nodes"][0]["tiers"][1].update(bandwidth=3), "field nodes.0.tiers.1.bandwidth"),
    (lambda d: d["nodes"][0]["tiers"][1].update(read_gbps=0), "field nodes.0.tiers.1.read_gbps"),
    (lambda d: d["nodes"][0]["tiers"][1].update(latency_us=-1), "field nodes.0.tiers.1.latency_us"),
    (lambda d: d["nodes"][0]["tiers"][1].update(kind="tape"), "field nodes.0.tiers.1.kind"),
    (lambda d: d["nodes"][0]["tiers"].append({"kind": "hbm", "capacity": "1GiB"}), "field nodes.0.tiers"),
    (lambda d: d["nodes"][0]["tiers"][2].pop("path"), "field nodes.0.tiers"),
    (lambda d: d["nodes"][0]["gpu"].update(count=0), "field nodes.0.gpu.count"),
    (lambda d: d["nodes"][0]["tiers"].append({"kind": "dram", "capacity": "1GiB"}), "each kind at most once, dram repeats"),
])
def test_bad_topology_names_the_field(tmp_path, change, field) -> None:
    data = cluster_dict(tmp_path)
    change(data)
    with pytest.raises(ConfigError) as err:
        load_cluster_config(write(tmp_path, data))
    assert field in str(err.value)


def test_a_cluster_tier_that_no_actor_runs_says_why(tmp_path) -> None:
    data = cluster_dict(tmp_path)
    data["nodes"][0]["tiers"].append({"kind": "rdma", "capacity": "1GiB"})
    with pytest.raises(ConfigError, match="field kind: a node's tier actor .* runs no rdma tier"):
        load_cluster_config(write(tmp_path, data))
    data["nodes"][0]["tiers"].pop()
    data["nodes"][0]["tiers"][2].pop("path")
    with pytest.raises(ConfigError, match="the nvme tier needs a directory"):
        load_cluster_config(write(tmp_path, data))


def test_block_tokens_is_set_in_the_cluster_file_only() -> None:
    from kvcluster.serve_apps.config import ServeAppConfig

    with pytest.raises(ValueError, match="block_tokens: the cluster YAML sets it"):
        ServeAppConfig(cluster="local", block_tokens=16)
    assert ServeAppConfig(cluster="local").block_tokens is None
    assert ServeAppConfig(cluster=None).block_tokens == 16  # an app without a cluster keeps its own
    (app,) = yaml.safe_load((ROOT / "configs" / "serve_runner.yaml").read_text())["applications"]
    assert "block_tokens" not in app["args"]
    assert ServeAppConfig.model_validate(app["args"]).cluster == "local"


def test_replay_topology_cli(tmp_path, capsys) -> None:
    assert main(["replay", FIXTURE, "--policy", "lru", "--topology", "local", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in data["results"][0]["tiers"]] == ["n0/dram", "n0/nvme", "n0/pfs"]
    assert data["model"] == "kvcluster-tiny-llama"
    assert main(["replay", FIXTURE, "--topology", "local", "--model", "llama-3.1-8b"]) == 2
    assert "--model: with --topology the cluster file's model sizes the blocks" in capsys.readouterr().err
    assert main(["replay", FIXTURE, "--topology", "local", "--capacity-blocks", "4"]) == 2
    assert "exactly one of" in capsys.readouterr().err
    data = cluster_dict(tmp_path)
    del data["nodes"][0]["gpu"]  # no GPUs: hit rates only, no TTFT projection
    assert main(["replay", FIXTURE, "--policy", "lru", "--topology", write(tmp_path, data)]) == 0
    out = capsys.readouterr().out
    assert "n0/dram=" in out and " - " in out


@pytest.mark.parametrize("written, nbytes", [
    ("512MiB", 512 << 20), ("1.5TiB", 3 << 39), ("4 GiB", 4 << 30), ("0.25gib", 1 << 28), ("2TB", 2 * 10**12),
    ("30.72TB", 30_720_000_000_000), ("4097B", 4097), ("1PB", 10**15),
])
def test_a_size_is_written_with_its_unit_and_reads_back(written, nbytes) -> None:
    from kvcluster.tiers import format_size, parse_size

    assert parse_size(written) == nbytes
    assert parse_size(format_size(nbytes)) == nbytes


@pytest.mark.parametrize("written, message", [
    (4, "4 has no unit"), ("4", "'4' is not a size"), ("4 bits", "is not a size"), ("0MiB", "at least one byte"),
    ("-1GiB", "is not a size"), (True, "expected a number and a unit"),
])
def test_a_size_without_a_unit_is_refused_naming_what_to_write(written, message) -> None:
    from kvcluster.tiers import parse_size

    with pytest.raises(ValueError, match=message) as err:
        parse_size(written)
    assert "e.g. 512MiB" in str(err.value) or written == "0MiB"


def test_a_tier_is_one_schema_in_a_tiers_file_a_cluster_file_the_actors_and_the_vllm_connector(tmp_path) -> None:
    """{kind, capacity, path}: the same TierSpec, the same bytes, wherever a tier is written."""
    from kvcluster.actors.tier_actor import TierActorConfig
    from kvcluster.integrations.vllm import store
    from kvcluster.tiers import TierSpec

    written = {"kind": "nvme", "capacity": "3MiB", "path": str(tmp_path / "nvme")}
    tiers_file = tmp_path / "node.yaml"
    tiers_file.write_text(yaml.safe_dump({"name": "x", "tiers": [written]}))
    data = cluster_dict(tmp_path)
    data["nodes"][0]["tiers"] = [written]
    from_tiers = load_node_tiers(str(tiers_file)).tiers[0]
    from_cluster = load_cluster_config(write(tmp_path, data)).node().tiers[0]
    from_connector = store.parse_config({"tiers": [written]}).tiers[0]
    actor = TierActorConfig(node="n0", tier=from_cluster, slot_bytes=1 << 20)
    assert from_tiers == from_cluster == from_connector == actor.tier == TierSpec(**written)
    assert from_cluster.capacity == 3 << 20 and actor.slots == 3
    assert TierActorConfig.model_validate(actor.model_dump()) == actor  # as a Ray actor receives it
    assert [t.kind for t in store.parse_config({"tiers": [written, {"kind": "dram", "capacity": "1MiB"}]}).tiers] \
        == ["dram", "nvme"]  # kept fastest first, by the one order


def test_the_tier_order_is_defined_once() -> None:
    import re

    defined = [str(p.relative_to(ROOT)) for d in ("kvcluster", "serve_apps", "actors") for p in (ROOT / d).rglob("*.py")
               if re.search(r"^\s*TIER_ORDER\s*[:=]", p.read_text(), re.M)]
    assert defined == ["kvcluster/tiers.py"]


@pytest.mark.parametrize("old, message", [
    ({"tier": "dram", "capacity_gib": 4}, "field tier, capacity_gib: a tier is written {kind, capacity} now, the "
                                          "capacity with its unit: kind: dram, capacity: 4GiB"),
    ({"kind": "dram", "capacity_mib": 512}, "field capacity_mib: .* capacity: 512MiB"),
])
def test_a_tier_in_an_older_schema_says_what_to_write(tmp_path, old, message) -> None:
    data = cluster_dict(tmp_path)
    data["nodes"][0]["tiers"][1] = old
    with pytest.raises(ConfigError, match=r"field nodes\.0\.tiers\.1: .*" + message.replace("{", r"\{").replace("}", r"\}")):
        load_cluster_config(write(tmp_path, data))


def test_every_shipped_config_writes_its_tiers_in_the_one_schema() -> None:
    """Tiers files, cluster files, k8s cluster files and the vLLM app's connector all load."""
    from kvcluster.serve_apps.vllm_config import load_app_config

    for path in sorted((ROOT / "configs" / "tiers").glob("*.yaml")):
        load_node_tiers(str(path))
    for path in sorted((ROOT / "configs" / "cluster").glob("*.yaml")) + sorted((ROOT / "k8s").rglob("cluster.yaml")):
        raw = yaml.safe_load(path.read_text())
        if "nodes" in raw:
            load_cluster_config(str(path))
    (app,) = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())["applications"]
    tiers = load_app_config(app["args"]).connector.tiers
    assert [t.kind for t in tiers] == ["dram", "nvme", "pfs"]
