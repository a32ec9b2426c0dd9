"""Block keys interned to small ints: the policies and tiers keep ints, never the keys themselves.

A key (a byte digest live, an int in the simulator) gets the lowest free id when it is first seen and keeps
it while its owner remembers the block. The table is swept once it holds twice what the last sweep kept:
the owner says which ids it still needs, the others are let go and their ids reused, so the table stays
within a constant factor of what the owner remembers, at amortized O(1) per new key. The cache manager
(tiers of one node) and the pool manager (one pool for the cluster) share it.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable

MIN_KEYS_SWEPT = 4096  # the table is swept at twice what it kept, and no sooner


class KeyTable:
    def __init__(self, sweep_from: int = MIN_KEYS_SWEPT) -> None:
        self.ids: dict[Hashable, int] = {}
        self.keys: list[Hashable | None] = []  # by id; None: an id let go, in `_free` for the next new key
        self._free: list[int] = []
        self._min_sweep = self._sweep_at = sweep_from

    def __len__(self) -> int:
        return len(self.ids)

    def intern(self, keys: Iterable[Hashable]) -> list[int]:
        """The id of each key, new keys taking free ids first."""
        ids, names, free, out = self.ids, self.keys, self._free, []
        for key in keys:
            i = ids.get(key)
            if i is None:
                if free:
                    i = ids[key] = free.pop()
                    names[i] = key
                else:
                    i = ids[key] = len(names)
                    names.append(key)
            out.append(i)
        return out

    def known(self, keys: Iterable[Hashable]) -> list[int | None]:
        ids = self.ids
        return [ids.get(k) for k in keys]

    def sweep(self, needed: Callable[[int], bool]) -> list[int]:
        """Once due (twice what the last sweep kept), let go of every id for which `needed(id)` is false.
        Returns the ids let go (none when not due)."""
        if len(self.ids) <= self._sweep_at:
            return []
        names = self.keys
        gone = [i for i, key in enumerate(names) if key is not None and not needed(i)]
        for i in gone:
            del self.ids[names[i]]
            names[i] = None
        self._free.extend(reversed(gone))  # the lowest ids are taken first
        self._sweep_at = max(self._min_sweep, 2 * len(self.ids))
        return gone

    def check_integrity(self) -> None:
        for key, i in self.ids.items():
            assert self.keys[i] == key, "each key's id names it back"
        assert all(self.keys[i] is None for i in self._free), "a free id names no key"
        assert len(self.ids) + len(self._free) == len(self.keys), "every id is a key's or free"
