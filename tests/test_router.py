"""Prefix-affinity ranking: replicas on the node holding the prefix first, unless they are full."""

from dataclasses import dataclass

from kvcluster.serve_apps.router import rank_by_node


@dataclass(frozen=True)
class Replica:
    replica_id: str
    node_id: str


A1, A2, B1 = Replica("a1", "node-a"), Replica("a2", "node-a"), Replica("b1", "node-b")


def test_replicas_on_the_prefix_node_rank_first():
    assert rank_by_node([B1, A1, A2], "node-a", {"a1", "a2", "b1"}) == [[A1, A2], [B1]]


def test_full_replicas_on_the_prefix_node_fall_back_to_the_rest():
    assert rank_by_node([B1, A1, A2], "node-a", {"a2", "b1"}) == [[A2], [B1, A1]]
    assert rank_by_node([B1, A1], "node-a", {"b1"}) == [[B1, A1]]


def test_a_node_without_replicas_gives_one_rank():
    assert rank_by_node([A1, B1], "node-c", {"a1", "b1"}) == [[A1, B1]]
    assert rank_by_node([A1, A2], "node-a", {"a1", "a2"}) == [[A1, A2]]
