"""Each node's chain of tiers, as its controller runs it: fastest first, a shared pfs split among the nodes that
mount it, and an online policy named by the cluster's field."""

from __future__ import annotations

from kvcluster.cluster_config import ClusterConfig
from kvcluster.cluster_control import node_chains


def two_nodes() -> ClusterConfig:
    return ClusterConfig.model_validate({
        "model": "kvcluster-tiny-llama", "checkpoint_dir": "/tmp/x",
        "nodes": [{"name": "a", "tiers": [{"kind": "pfs", "capacity": "1GiB", "path": "/shared"},
                                          {"kind": "dram", "capacity": "1GiB"}]},
                  {"name": "b", "ray_resource": "b", "tiers": [{"kind": "dram", "capacity": "1GiB"},
                                                               {"kind": "pfs", "capacity": "1GiB", "path": "/shared"}]}]})


def test_chains_run_fastest_first_and_split_a_shared_pfs() -> None:
    slots = {("a", "dram"): 4, ("a", "pfs"): 10, ("b", "dram"): 3, ("b", "pfs"): 10}
    chains = node_chains(two_nodes(), slots)
    assert [(t.label, t.capacity_blocks) for t in chains["a"]] == [("a/dram", 4), ("a/pfs", 5)]
    assert [(t.label, t.capacity_blocks) for t in chains["b"]] == [("b/dram", 3), ("b/pfs", 5)]


def test_the_cluster_policy_is_an_online_policy_named_by_its_field(tmp_path) -> None:
    import pytest

    from kvcluster.cluster_config import load_cluster_config
    from kvcluster.errors import ConfigError

    assert two_nodes().policy == "bayes"  # the default is what `kvcluster replay` runs by default
    base = two_nodes().model_dump(mode="json")
    for policy, why in (("belady", "reads the future"), ("fifo-ish", "unknown policy")):
        path = tmp_path / f"{policy}.yaml"
        path.write_text(__import__("yaml").safe_dump({**base, "policy": policy}))
        with pytest.raises(ConfigError) as err:
            load_cluster_config(str(path))
        assert "policy" in str(err.value) and why in str(err.value)
