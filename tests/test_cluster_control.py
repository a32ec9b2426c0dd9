"""Per-node hierarchies under one control plane: blocks follow the node that uses them, never in zero
places; a shared pfs is split among the nodes that mount it; a restart rebuilds the view from the tiers."""

from __future__ import annotations

import numpy as np

from kvcluster.cluster_config import ClusterConfig
from kvcluster.cluster_control import NodeCaches, node_chains
from test_cache_manager import DictTiers, key_of, payload_of


def two_nodes() -> ClusterConfig:
    return ClusterConfig.model_validate({
        "model": "kvcluster-tiny-llama", "checkpoint_dir": "/tmp/x",
        "nodes": [{"name": "a", "tiers": [{"tier": "pfs", "capacity_gib": 1, "path": "/shared"},
                                          {"tier": "dram", "capacity_gib": 1}]},
                  {"name": "b", "ray_resource": "b", "tiers": [{"tier": "dram", "capacity_gib": 1},
                                                               {"tier": "pfs", "capacity_gib": 1, "path": "/shared"}]}]})


def test_chains_run_fastest_first_and_split_a_shared_pfs() -> None:
    slots = {("a", "dram"): 4, ("a", "pfs"): 10, ("b", "dram"): 3, ("b", "pfs"): 10}
    chains = node_chains(two_nodes(), slots)
    assert [(t.label, t.capacity_blocks) for t in chains["a"]] == [("a/dram", 4), ("a/pfs", 5)]
    assert [(t.label, t.capacity_blocks) for t in chains["b"]] == [("b/dram", 3), ("b/pfs", 5)]


def make(policy: str = "lru"):
    chains = node_chains(two_nodes(), {("a", "dram"): 2, ("a", "pfs"): 8, ("b", "dram"): 2, ("b", "pfs"): 8})
    io = {node: DictTiers([t.capacity_blocks for t in chain]) for node, chain in chains.items()}
    return NodeCaches({node: [t.plan() for t in chain] for node, chain in chains.items()}, io, policy), io


def held(keys):
    return {k: (payload_of(k), None) for k in keys}


def assert_match(caches: NodeCaches, io) -> None:
    for node, manager in caches.managers.items():
        for t, resident in enumerate(manager.resident().values()):
            assert set(resident) == set(io[node].tiers[t])
            for k in resident:
                assert np.array_equal(io[node].tiers[t][k], payload_of(k))
    everywhere = [k for m in caches.managers.values() for r in m.resident().values() for k in r]
    assert len(everywhere) == len(set(everywhere)), "a block lives in two nodes' hierarchies"


def test_a_block_used_on_another_node_migrates_there() -> None:
    caches, io = make()
    ks = [key_of(i) for i in range(1, 5)]
    caches.commit("a", ks[:2], held(ks[:2]))
    caches.commit("a", ks[2:], held(ks[2:]))  # ks[:2] fall to a's pfs share
    assert caches.managers["a"].tier_of(ks[0]) == 1
    plan, failed = caches.commit("b", ks[:2], {})  # b's replica read them (over NIXL) and sent no bytes
    assert failed == [] and caches.totals["migrated"] == 2
    assert [caches.managers["b"].tier_of(k) for k in ks[:2]] == [0, 0]
    assert [caches.managers["a"].tier_of(k) for k in ks[:2]] == [None, None]
    assert_match(caches, io)


def test_a_migration_whose_source_cannot_be_read_keeps_nothing_and_deletes_nothing() -> None:
    caches, io = make()
    k = key_of(7)
    caches.commit("a", [k], held([k]))
    io["a"].unreadable.add(k)
    plan, failed = caches.commit("b", [k], {})
    assert caches.managers["b"].tier_of(k) is None and caches.managers["a"].tier_of(k) == 0
    assert k in io["a"].tiers[0]  # the source stays: it was never copied
    assert_match(caches, io)


def test_a_restarted_control_plane_adopts_what_the_tiers_hold() -> None:
    caches, io = make()
    ks = [key_of(i) for i in range(1, 6)]
    for k in ks:
        caches.commit("a", [k], held([k]))
    fresh = NodeCaches(caches.chains, io, "lru")
    for t in range(2):
        extra = fresh.adopt("a", t, list(io["a"].tiers[t]))
        assert extra == []
    assert fresh.managers["a"].occupancy() == caches.managers["a"].occupancy()
    assert_match(fresh, io)


class PullingTiers(DictTiers):
    """A data plane whose tiers can pull from another node's memory tier (what NIXL does between nodes)."""

    registry: dict = {}

    def __init__(self, node: str, capacities: list[int]) -> None:
        super().__init__(capacities)
        self.node = node
        self.pulls = 0
        PullingTiers.registry[node] = self

    def nixl_source(self, tier: int) -> str | None:
        return f"{self.node}:{tier}" if tier == 0 else None  # only the memory tier lends its pool

    def pull(self, tier: int, source: str, keys: list[bytes]) -> list[bool | None]:
        self.pulls += 1
        node, src_tier = source.split(":")
        got = [PullingTiers.registry[node].tiers[int(src_tier)].get(k) for k in keys]
        ok = self.write({tier: ([k for k, g in zip(keys, got) if g is not None], [g for g in got if g is not None],
                                [None] * len(keys))})[tier]
        it = iter(ok)
        return [None if g is None else next(it) for g in got]


def test_a_migration_from_a_memory_tier_is_one_pull_and_the_rest_go_through_the_mover() -> None:
    chains = node_chains(two_nodes(), {("a", "dram"): 3, ("a", "pfs"): 8, ("b", "dram"): 3, ("b", "pfs"): 8})
    io = {node: PullingTiers(node, [t.capacity_blocks for t in chain]) for node, chain in chains.items()}
    caches = NodeCaches({node: [t.plan() for t in chain] for node, chain in chains.items()}, io, "lru")
    ks = [key_of(i) for i in range(1, 6)]
    caches.commit("a", ks[:2], held(ks[:2]))
    caches.commit("a", ks[2:], held(ks[2:]))  # a/dram: ks[2:5]; a/pfs: ks[0:2]
    plan, failed = caches.commit("b", [ks[0], ks[2], ks[3]], {})
    assert failed == [] and io["b"].pulls == 1 and caches.totals["pulled"] == 2  # ks[2], ks[3] from a's dram
    assert caches.totals["migrated"] == 3  # ks[0] came from a's pfs through the mover
    assert [caches.managers["b"].tier_of(k) for k in (ks[0], ks[2], ks[3])] == [0, 0, 0]
    assert_match(caches, io)


def test_a_restarted_tier_is_resynced_to_what_it_holds_now() -> None:
    caches, io = make()
    ks = [key_of(i) for i in range(1, 4)]
    caches.commit("a", ks[:2], held(ks[:2]))
    io["a"].tiers[0].clear()  # a's dram restarted empty
    io["a"].tiers[0][ks[2]] = payload_of(ks[2])  # and has since received one block
    assert caches.resync("a", 0, [ks[2]]) == []
    assert [caches.managers["a"].tier_of(k) for k in ks] == [None, None, 0]
    assert_match(caches, io)


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
