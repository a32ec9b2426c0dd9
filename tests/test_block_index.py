"""Global block index: prefix lookups across nodes and tiers, losses, integrity."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvcluster.block_index import BlockIndex
from kvcluster.keys import KeySpace

KEYS = KeySpace(model="idx").chain_hash_ids(list(range(8)))


def test_longest_prefix_and_where() -> None:
    idx = BlockIndex()
    idx.stored("a", "nvme", KEYS[:4])
    idx.stored("b", "dram", KEYS[:2])
    idx.stored("b", "pfs", KEYS[5:6])
    m = idx.longest_prefix(KEYS)
    assert m.length == 4
    assert m.locations[0] == (("b", "dram"), ("a", "nvme"))
    assert m.best_node() == "a"  # holds all four
    idx.lost("a")
    assert idx.longest_prefix(KEYS).length == 2 and idx.occupancy() == {"b": {"dram": 2, "pfs": 1}}
    idx.check_integrity()


def test_a_workers_part_of_a_tier_sorts_as_its_kind_and_is_lost_alone() -> None:
    """Tensor-parallel workers lend their pages as "hbm/tp{rank}-of-{size}": each is a tier of its own to the
    index (one worker's restart clears its part only), ordered as hbm."""
    idx = BlockIndex()
    idx.stored("a", "dram", KEYS[:2])
    idx.stored("a", "hbm/tp1-of-2", KEYS[:2])
    idx.stored("a", "hbm/tp0-of-2", KEYS[2:4])
    assert idx.locate(KEYS[:3]) == [(("a", "hbm/tp1-of-2"), ("a", "dram"))] * 2 + [(("a", "hbm/tp0-of-2"),)]
    idx.lost("a", "hbm/tp1-of-2")
    assert idx.locate(KEYS[:3]) == [(("a", "dram"),)] * 2 + [(("a", "hbm/tp0-of-2"),)]
    idx.check_integrity()


@given(st.lists(st.tuples(st.sampled_from(["stored", "removed", "lost"]), st.sampled_from("abc"),
                          st.sampled_from(["dram", "nvme", "pfs"]), st.integers(0, 7), st.integers(1, 8))))
def test_index_stays_consistent(events) -> None:
    idx = BlockIndex()
    truth: set[tuple[str, str, bytes]] = set()
    for op, node, tier, lo, n in events:
        keys = KEYS[lo : lo + n]
        if op == "stored":
            idx.stored(node, tier, keys)
            truth |= {(node, tier, k) for k in keys}
        elif op == "removed":
            idx.removed(node, tier, keys)
            truth -= {(node, tier, k) for k in keys}
        else:
            idx.lost(node, tier)
            truth = {t for t in truth if t[:2] != (node, tier)}
        idx.check_integrity()
    held = {k for _, _, k in truth}
    expect = next((i for i, k in enumerate(KEYS) if k not in held), len(KEYS))
    assert idx.longest_prefix(KEYS).length == expect
