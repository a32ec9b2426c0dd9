"""The owner's side of the NIXL peer protocol, written once for every actor that lends a pool.

Other nodes read (and write) a lent pool's slab directly over NIXL; what they ask
the owner goes through these batch calls (`kvcluster.storage.rdma.PeerControl`):
`connect` (exchange NIXL metadata once), `lookup` (where keys lie in the slab),
`reserve`/`commit` (a writer's slots, readable only once committed), `release`
and `usage`. Committed and released keys are reported to the index.

A Ray actor class inherits `PeerServer` and provides `_lend()` (its `NixlPeerPool`)
and `reporter` (its `IndexReporter`); the methods below become its remote methods.
`_looked_up` is the hook for an owner that counts a lookup as a read of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcluster.tiers import NIXL_TIERS

from .index_reporter import IndexReporter

if TYPE_CHECKING:  # torch comes with it: only a memory tier that lends its pool loads it
    from kvcluster.storage import NixlPeerPool

MEMORY_TIERS = NIXL_TIERS  # tiers whose pool is a slab other nodes can read over NIXL (kvcluster.tiers)


class PeerServer:
    reporter: IndexReporter

    def _lend(self) -> NixlPeerPool:
        """The pool this actor lends to other nodes (raise ValueError where it lends none). Every actor
        class built on `PeerServer` defines it (`TierActor`, `PeerPoolActor`)."""
        raise TypeError(f"{type(self).__name__} builds on PeerServer but does not say which pool it lends")

    def _looked_up(self, keys: list[bytes], entries: list[tuple[int, int, int] | None]) -> None:
        """A reader looked `keys` up and reads the ones found next (default: nothing to account)."""

    def connect(self, client_metadata: bytes) -> tuple[bytes, bytes, int, str]:
        return self._lend().connect(client_metadata)

    def lookup(self, keys: list[bytes]) -> list[tuple[int, int, int] | None]:
        """(slot, length, checksum) of each key in the slab, or None."""
        entries = self._lend().lookup(keys)
        self._looked_up(keys, entries)
        return entries

    def reserve(self, keys: list[bytes], lengths: list[int]) -> list[int | None]:
        return self._lend().reserve(keys, lengths)

    def commit(self, keys: list[bytes], slots: list[int], lengths: list[int], digests: list[int]) -> None:
        self._lend().commit(keys, slots, lengths, digests)
        self.reporter.stored(keys)

    def release(self, keys: list[bytes]) -> int:
        self.reporter.removed(keys)
        return self._lend().release(keys)

    def usage(self) -> int:
        return self._lend().usage()
