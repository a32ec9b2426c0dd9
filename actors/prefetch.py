"""Which blocks of a tier were promoted ahead of use and are not read yet.

A caller that puts (or pulls) blocks into a tier with `prefetch=True` promotes
them ahead of a predicted reuse; whether a prefetch paid off is known only later,
at the tier: read while still there (a hit) or deleted unread (wasted). Those
outcomes are what says if promotion is worth its bytes, so the tier tracks each
promoted key until one of them happens.
"""

from __future__ import annotations

from typing import Iterable


class PrefetchTracker:
    """Promoted keys not read yet. Not thread-safe: one actor's calls run one at a time."""

    def __init__(self) -> None:
        self._unread: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._unread)

    def promoted(self, keys: Iterable[bytes]) -> None:
        """`keys` were stored here by a promotion."""
        self._unread.update(keys)

    def read(self, keys: Iterable[bytes]) -> int:
        """`keys` were found by a read: how many of them were unread prefetches (hits); they stop being tracked."""
        return self._settle(keys)

    def dropped(self, keys: Iterable[bytes]) -> int:
        """`keys` leave the tier: how many of them were never read (wasted prefetches); they stop being tracked."""
        return self._settle(keys)

    def _settle(self, keys: Iterable[bytes]) -> int:
        if not self._unread:  # the common case: nothing promoted is waiting, the keys are not even looked at
            return 0
        settled = [k for k in keys if k in self._unread]
        self._unread.difference_update(settled)
        return len(settled)
