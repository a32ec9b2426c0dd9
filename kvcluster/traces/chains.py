"""Block keys for hash-id lists, computed once per new block.

Consecutive requests of a session re-send most of their prefix, so hashing every
block of every request would cost O(refs) BLAKE2b calls (5.5 M for the Claude
Code traces). `HashKeyChain` keeps, per stream (a session), the previous id list
and its keys; the next list reuses the keys of the common prefix and hashes only
the rest. Keys equal `KeySpace.chain_hash_ids` of the labelled ids exactly.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

from ..keys import BlockKey, KeySpace

Label = Callable[[int, int], object]  # (position, hash id) -> what is hashed


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix; slice compares run in C (binary search)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class HashKeyChain:
    """Prefix-chained keys of hash-id lists from one root, reusing each stream's last prefix.

    `label(position, hash_id)` maps an id to what is hashed (e.g. a namespaced
    string). It must depend only on the ids up to that position, which holds for
    any per-session namespace and for replacing a fixed leading run.
    """

    def __init__(self, space: KeySpace, cache_salt: str = "") -> None:
        self._space = space
        self._root = space.root(cache_salt)
        self._last: dict[Hashable, tuple[list, tuple[BlockKey, ...]]] = {}

    def keys(self, ids: list, stream: Hashable = "", label: Label | None = None) -> tuple[BlockKey, ...]:
        last = self._last.get(stream)
        reuse = common_prefix_len(ids, last[0]) if last else 0
        keys = list(last[1][:reuse]) if reuse else []
        parent = keys[-1] if keys else self._root
        child = self._space.child_of_hash_id
        for position in range(reuse, len(ids)):
            parent = child(parent, ids[position] if label is None else label(position, ids[position]))
            keys.append(parent)
        out = tuple(keys)
        self._last[stream] = (ids, out)
        return out
