"""One tier actor's metrics: the names, tags and arithmetic of everything a tier records.

Tagged with the tier's node and tier (faults with `component="<node>/<tier>"`), each
record is one local call to `ray.util.metrics` (see `kvcluster.actors.metrics`); a
count of zero records nothing (Ray's counters refuse increments that are not positive).
"""

from __future__ import annotations

from kvcluster.storage import StorageBackend

from . import metrics


class TierMetrics:
    def __init__(self, node: str, tier: str) -> None:
        self.tags = {"node": node, "tier": tier}
        self.where = f"{node}/{tier}"

    def fault(self, kind: str, n: int = 1) -> None:
        """`n` faults absorbed as misses (kind: restarted, put_refused, corrupt, ...)."""
        if n > 0:
            metrics.faults().inc(n, {"component": self.where, "kind": kind})

    def reads(self, asked: int, missing: int, corrupt: int) -> None:
        """A read of `asked` blocks of which `missing` were not served, `corrupt` of those because their
        checksum failed (dropped here, so also a fault)."""
        lookups = metrics.tier_lookups()
        if asked > missing:
            lookups.inc(asked - missing, {**self.tags, "outcome": "hit"})
        if missing > corrupt:
            lookups.inc(missing - corrupt, {**self.tags, "outcome": "miss"})
        if corrupt > 0:
            lookups.inc(corrupt, {**self.tags, "outcome": "corrupt"})
            self.fault("corrupt", corrupt)

    def prefetch(self, outcome: str, n: int) -> None:
        """`n` prefetched blocks settled here: hit (read) or wasted (deleted unread)."""
        if n > 0:
            metrics.prefetches().inc(n, {"outcome": outcome})

    def occupancy(self, backend: StorageBackend) -> None:
        """The bytes `backend` holds and can hold, as gauges."""
        metrics.tier_bytes().set(backend.used_bytes, {**self.tags, "kind": "used"})
        metrics.tier_bytes().set(backend.capacity_bytes, {**self.tags, "kind": "capacity"})
