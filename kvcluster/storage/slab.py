"""Fixed-size slots with a free list: the allocator under every pool and slab file.

Why slots: block payloads of one model have a bounded size, so a preallocated
slab never fragments and a put is one copy into a known offset.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..keys import BlockKey


@dataclass
class SlotEntry:
    slot: int
    length: int
    checksum: int


class SlotTable:
    """key -> slot bookkeeping; `free + used == total` always."""

    def __init__(self, slots: int) -> None:
        if slots <= 0:
            raise ValueError("a slab needs at least one slot")
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))
        self._entries: dict[BlockKey, SlotEntry] = {}

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: BlockKey) -> SlotEntry | None:
        return self._entries.get(key)

    def keys(self) -> list[BlockKey]:
        return list(self._entries)

    @property
    def free(self) -> int:
        """Slots no key holds."""
        return len(self._free)

    def allocate(self, key: BlockKey) -> int | None:
        """The slot for `key` (its old one when overwriting), or None when full."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry.slot
        return self._free.pop() if self._free else None

    def commit(self, key: BlockKey, slot: int, length: int, checksum: int) -> None:
        self._entries[key] = SlotEntry(slot, length, checksum)

    def release(self, key: BlockKey) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._free.append(entry.slot)
        return True

    def abandon(self, slot: int) -> None:
        """Give back a slot allocated for a put that failed."""
        if slot not in {e.slot for e in self._entries.values()}:
            self._free.append(slot)

    def check_integrity(self) -> None:
        used = {e.slot for e in self._entries.values()}
        assert len(used) == len(self._entries), "two keys share a slot"
        assert not used & set(self._free), "a slot is both free and used"
        assert len(used) + len(self._free) == self.slots, "free + used != total"
