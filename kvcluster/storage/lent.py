"""`LentDirectory`: where the blocks of memory lent by another process lie, for the NIXL peer protocol.

An engine lends its paged KV (`NixlRegionLender` registers it in the engine's process), but the engine owns
those pages: it fills them, frees them and reuses them for other blocks without asking anyone. So the
directory of what is readable there lives in a control actor and follows the engine's reports, one batch
per engine step: blocks that entered (a block id, its length and digest) and keys whose pages were
rewritten. It answers the peer protocol's calls like a pool's slot table does, read-only: a reader never
reserves a slot here. The reports trail the engine by up to a step, so a reader may find a block whose
pages were just rewritten: its digest no longer matches what landed, the reader counts a corrupt block
(a miss) and releases the key here. A digest is what makes a lent page safe to read, never the timing.
"""

from __future__ import annotations

from ..keys import BlockKey
from .slab import SlotEntry


class LentDirectory:
    def __init__(self, metadata: bytes, descs: bytes, slot_bytes: int, agent_name: str) -> None:
        """The lender's NIXL agent metadata, its regions' serialized descriptors and agent name (as
        `NixlRegionLender` has them); `slot_bytes`: one block's bytes, all its pages."""
        self._connect = (metadata, descs, slot_bytes, agent_name)
        self.slot_bytes = slot_bytes
        self._entries: dict[BlockKey, SlotEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        return [bytes(k) for k in self._entries]

    def update(self, entered: list[tuple[bytes, int, int, int]], left: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Apply one report: `left` keys go first, then `entered` (key, slot, length, digest) are readable (a key
        that left and entered again in one report is readable at its new slot). Returns the keys that became
        readable and those that stopped being readable, for the index."""
        too_long = [length for _, _, length, _ in entered if length > self.slot_bytes]
        if too_long:  # refused whole, before anything changes: the directory and the index stay in step
            raise ValueError(f"lent blocks of {too_long[:3]} bytes in slots of {self.slot_bytes}")
        gone = [k for k in left if self._entries.pop(BlockKey(k), None) is not None]
        came = []
        for key, slot, length, digest in entered:
            self._entries[BlockKey(key)] = SlotEntry(slot, length, digest)
            came.append(key)
        arrived = set(came)
        return came, [k for k in gone if k not in arrived]

    # -- the peer protocol (PeerControl), read-only -------------------------------------------------

    def connect(self, client_metadata: bytes) -> tuple[bytes, bytes, int, str]:
        """The lender's metadata and regions. The client's metadata is not needed: NIXL reads are one-sided."""
        return self._connect

    def lookup(self, keys: list[bytes]) -> list[tuple[int, int, int] | None]:
        entries = [self._entries.get(BlockKey(k)) for k in keys]
        return [(e.slot, e.length, e.checksum) if e else None for e in entries]

    def reserve(self, keys: list[bytes], lengths: list[int]) -> list[int | None]:
        """Nothing is written into lent memory: its owner decides what its pages hold."""
        return [None] * len(keys)

    def commit(self, keys: list[bytes], slots: list[int], lengths: list[int], digests: list[int]) -> None:
        if keys:
            raise ValueError("lent memory takes no writes (no slot was reserved)")

    def release(self, keys: list[bytes]) -> int:
        """A reader found these keys missing or corrupt: they are not offered again until reported anew."""
        return sum(self._entries.pop(BlockKey(k), None) is not None for k in keys)

    def usage(self) -> int:
        return len(self._entries) * self.slot_bytes
