"""KeyTable: a key keeps its id while needed, a sweep lets go only what is not, and the table stays bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.key_table import KeyTable


def test_ids_are_dense_stable_and_reused_lowest_first() -> None:
    table = KeyTable(sweep_from=2)
    assert table.intern([b"a", b"b", b"a", b"c"]) == [0, 1, 0, 2]
    assert table.known([b"c", b"zz"]) == [2, None]
    assert table.sweep(lambda i: i == 1) == [0, 2]  # 3 keys > 2: due
    assert table.known([b"a", b"b", b"c"]) == [None, 1, None]
    assert table.intern([b"d", b"e", b"f"]) == [0, 2, 3]  # the freed ids first, lowest first
    assert table.sweep(lambda i: i != 1) == [1]  # 4 keys, past twice the 1 kept: due
    assert table.known([b"b", b"d", b"e", b"f"]) == [None, 0, 2, 3]
    assert table.sweep(lambda i: False) == []  # 3 keys, not past twice the 3 kept
    table.check_integrity()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 40), max_size=8), st.sets(st.integers(0, 40), max_size=10)),
                max_size=40))
def test_a_sweep_lets_go_exactly_the_keys_not_needed(steps) -> None:
    """Each step interns some keys and names the keys still needed; needed keys never change id, and after a
    sweep the table holds at most the needed keys plus what was interned since."""
    table, seen = KeyTable(sweep_from=4), {}
    for keys, needed in steps:
        for key, i in zip(keys, table.intern(keys)):
            assert seen.setdefault(key, i) == i  # a key's id holds while the table has it
        kept_ids = {table.ids[k] for k in needed if k in table.ids}
        before = dict(table.ids)
        gone = table.sweep(lambda i: i in kept_ids)
        assert set(gone) == ({before[k] for k in before} - kept_ids if gone else set())
        for key in [k for k, i in before.items() if i in gone]:
            del seen[key]
        assert all(table.ids[k] == i for k, i in before.items() if i in kept_ids)
        table.check_integrity()
        assert len(table) <= max(4, 2 * len(kept_ids)) + len(keys) or not gone
