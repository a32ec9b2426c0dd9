"""The block index split over shards, and the read-only copy that follows its journals: pure logic.

Sharded lookups must answer exactly what one index would; a follower fed the journal's changes (or a
snapshot when it fell behind or the shard restarted) must equal the index it follows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.block_index import BlockIndex, PrefixMatch, merge_prefix, prefix_runs, shard_of, split_by_shard
from kvcluster.index_journal import IndexFollower, IndexJournal
from kvcluster.keys import KeySpace

KEYS = [bytes(k) for k in KeySpace(model="shards").chain_hash_ids(list(range(40)))]
LOCATIONS = [("a", "dram"), ("a", "nvme"), ("b", "dram"), ("b", "pfs")]

operation = st.tuples(st.sampled_from(["stored", "removed", "lost"]), st.sampled_from(LOCATIONS),
                      st.lists(st.integers(0, len(KEYS) - 1), max_size=12))


def apply(index: BlockIndex, op: str, loc: tuple[str, str], picks: list[int]) -> None:
    keys = [KEYS[i] for i in picks]
    if op == "stored":
        index.stored(*loc, keys)
    elif op == "removed":
        index.removed(*loc, keys)
    else:
        index.lost(*loc)


def whole_and_shards(ops, shards: int) -> tuple[BlockIndex, list[BlockIndex]]:
    """One index and `shards` shards of it, after the same operations (a lost node is lost on every shard)."""
    whole, parts = BlockIndex(), [BlockIndex() for _ in range(shards)]
    for op, loc, picks in ops:
        apply(whole, op, loc, picks)
        for s, (_, owned) in split_by_shard([KEYS[i] for i in picks], shards).items():
            apply(parts[s], op, loc, [KEYS.index(k) for k in owned])
        if op == "lost":
            for part in parts:
                part.lost(*loc)
    return whole, parts


def sharded_prefix(shards: list[BlockIndex], keys: list[bytes]) -> PrefixMatch:
    parts = split_by_shard(keys, len(shards))
    return merge_prefix(len(keys), ((pos, shards[s].locate(owned)) for s, (pos, owned) in parts.items()))


def test_shard_of_is_fixed_by_the_key_bytes() -> None:
    key = bytes(range(32))
    assert shard_of(key, 1) == 0
    assert shard_of(key, 3) == int.from_bytes(bytes(range(8)), "little") % 3 == 1
    assert split_by_shard([key, key], 3) == {1: ([0, 1], [key, key])}


def test_every_shard_gets_a_share_of_real_keys() -> None:
    counts = [0] * 4
    for key in KEYS:
        counts[shard_of(key, 4)] += 1
    assert min(counts) >= 4 and sum(counts) == len(KEYS)


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=30), st.integers(1, 5), st.integers(0, len(KEYS)), st.integers(0, len(KEYS)))
def test_sharded_lookups_equal_one_index(ops, shards, start, stop) -> None:
    whole, parts = whole_and_shards(ops, shards)
    keys = KEYS[min(start, stop):max(start, stop)]
    assert sharded_prefix(parts, keys) == whole.longest_prefix(keys)


@settings(max_examples=100, deadline=None)
@given(st.lists(operation, max_size=30), st.integers(1, 5),
       st.lists(st.tuples(st.integers(0, len(KEYS)), st.integers(0, len(KEYS))), max_size=4))
def test_runs_of_chains_asked_together_equal_one_lookup_each(ops, shards, spans) -> None:
    """Tensor-parallel workers' shards of one prefix are asked in one `locate` per index shard: each chain's
    run must be what its own longest-prefix lookup would say."""
    whole, parts = whole_and_shards(ops, shards)
    chains = [KEYS[min(a, b):max(a, b)] for a, b in spans]
    flat = [k for chain in chains for k in chain]
    answers = ((pos, parts[s].locate(owned)) for s, (pos, owned) in split_by_shard(flat, shards).items())
    assert prefix_runs([len(c) for c in chains], answers) == [whole.longest_prefix(c).length for c in chains]


def _logged(index: BlockIndex, journal: IndexJournal, op: str, loc, picks: list[int]) -> None:
    apply(index, op, loc, picks)
    journal.record(op, *loc, [KEYS[i] for i in picks] if op != "lost" else [])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(operation, st.booleans()), max_size=40), st.integers(1, 30))
def test_a_follower_equals_the_index_it_follows(steps, capacity) -> None:
    """Refreshes at random points; a small journal forces snapshots when the follower falls behind."""
    index = BlockIndex()
    journal = IndexJournal(index, capacity_keys=capacity)
    follower = IndexFollower(1)
    for (op, loc, picks), refresh in steps:
        _logged(index, journal, op, loc, picks)
        if refresh:
            follower.apply(0, journal.since(*follower.positions[0]))
            assert follower.copies[0].occupancy() == index.occupancy()
    follower.apply(0, journal.since(*follower.positions[0]))
    assert follower.longest_prefix(KEYS) == index.longest_prefix(KEYS)
    assert follower.copies[0].occupancy() == index.occupancy()
    follower.copies[0].check_integrity()


def test_a_follower_gets_only_the_changes_it_missed_then_a_snapshot_when_too_far_behind() -> None:
    index = BlockIndex()
    journal = IndexJournal(index, capacity_keys=4)
    follower = IndexFollower(1)
    first = journal.since(*follower.positions[0])
    assert first.snapshot == () and first.cursor == 0  # nothing yet: an empty snapshot
    follower.apply(0, first)
    _logged(index, journal, "stored", ("a", "dram"), [0, 1])
    changes = journal.since(*follower.positions[0])
    assert changes.snapshot is None and changes.changes == (("stored", "a", "dram", KEYS[:2]),)
    follower.apply(0, changes)
    for i in range(2, 8):  # 6 more keys' worth: more than the journal keeps
        _logged(index, journal, "stored", ("b", "pfs"), [i])
    behind = journal.since(*follower.positions[0])
    assert behind.snapshot is not None and behind.cursor == 7
    follower.apply(0, behind)
    assert follower.longest_prefix(KEYS[:8]).length == 8


def test_a_restarted_shard_sends_a_snapshot() -> None:
    index = BlockIndex()
    follower = IndexFollower(1)
    follower.apply(0, IndexJournal(index).since(None, 0))
    index.stored("a", "dram", KEYS[:3])
    again = IndexJournal(index)  # a new incarnation numbers from 0 with another epoch
    changes = again.since(*follower.positions[0])
    assert [(n, t, sorted(k)) for n, t, k in changes.snapshot] == [("a", "dram", sorted(KEYS[:3]))]
    follower.apply(0, changes)
    assert follower.longest_prefix(KEYS[:3]).length == 3


def test_a_follower_of_several_shards_merges_like_the_client() -> None:
    shards = [BlockIndex() for _ in range(3)]
    journals = [IndexJournal(s) for s in shards]
    for s, (_, owned) in split_by_shard(KEYS[:10], 3).items():
        shards[s].stored("a", "dram", owned)
        journals[s].record("stored", "a", "dram", owned)
    follower = IndexFollower(3)
    for s, journal in enumerate(journals):
        follower.apply(s, journal.since(*follower.positions[s]))
    assert follower.longest_prefix(KEYS[:12]) == sharded_prefix(shards, KEYS[:12])
    assert follower.longest_prefix(KEYS[:12]).length == 10
