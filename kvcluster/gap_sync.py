"""What the reuse-gap models learn, pooled across the cluster through the predictor.

Each node's `bayes` policy learns its hazards (`GapModel` counts) from the requests
its node serves. The cluster's predictor keeps the sum of every policy's counts:
a policy sends what it counted since its last sync (`GapSync.delta`) and takes the
cluster's totals back (`GapSync.install`). So every node ranks blocks with what all
nodes have seen, and a restarted control plane starts from the predictor's
checkpointed totals instead of from the prior alone.

Each count is sent once: a delta is measured from the totals last installed, so a
node never adds its own past counts twice. Counts grow, but for a request group
that an answer told late moves to another class (`BayesPolicy.answered`): its counts
leave one class for the other, and the delta carries both, the totals' sum unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .reuse_gap import GapModel

Rows = list[list[float]]  # classes x age bins


@dataclass
class GapCounts:
    """`reached` and `reused` counts, classes x bins, and `groups` per class (see `GapModel`)."""

    reached: Rows
    reused: Rows
    groups: list[float] = field(default_factory=list)  # empty: none counted (totals from before they were)

    def __post_init__(self) -> None:
        if not self.groups:
            self.groups = [0.0] * len(self.reached)
        if len(self.groups) != len(self.reached):
            raise ValueError(f"{len(self.groups)} group counts for {len(self.reached)} classes")

    @classmethod
    def zeros(cls, classes: int, bins: int) -> "GapCounts":
        return cls([[0.0] * bins for _ in range(classes)], [[0.0] * bins for _ in range(classes)], [0.0] * classes)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.reached), len(self.reached[0]) if self.reached else 0

    def add(self, other: "GapCounts") -> None:
        if other.shape != self.shape:
            raise ValueError(f"gap counts of shape {other.shape} cannot join counts of shape {self.shape}")
        for mine, theirs in ((self.reached, other.reached), (self.reused, other.reused)):
            for row, add in zip(mine, theirs):
                for k, v in enumerate(add):
                    row[k] += v
        for c, v in enumerate(other.groups):
            self.groups[c] += v

    def total_reached(self) -> float:
        """Block uses learnt from (every use enters bin 0)."""
        return sum(row[0] for row in self.reached) if self.reached else 0.0

    def to_dict(self) -> dict:
        return {"reached": self.reached, "reused": self.reused, "groups": self.groups}

    @classmethod
    def from_dict(cls, raw: dict) -> "GapCounts":
        return cls([list(map(float, r)) for r in raw["reached"]], [list(map(float, r)) for r in raw["reused"]],
                   list(map(float, raw.get("groups", ()))))


class GapSync:
    """One policy's `GapModel` and the totals it last installed."""

    def __init__(self, model: GapModel) -> None:
        self.model = model
        self._base = GapCounts.zeros(model.classes, model.config.bins)

    def delta(self) -> GapCounts:
        """Counts the model gained since the last `install` (or since it was built)."""
        return GapCounts([[m - b for m, b in zip(mr, br)] for mr, br in zip(self.model.reached, self._base.reached)],
                         [[m - b for m, b in zip(mr, br)] for mr, br in zip(self.model.reused, self._base.reused)],
                         [m - b for m, b in zip(self.model.groups, self._base.groups)])

    def install(self, totals: GapCounts) -> None:
        """Make the model's counts the cluster's `totals` (in place: the policy holds references to the rows)."""
        if totals.shape != (self.model.classes, self.model.config.bins):
            raise ValueError(f"gap counts of shape {totals.shape} do not fit this model")
        for mine, theirs in ((self.model.reached, totals.reached), (self.model.reused, totals.reused)):
            for row, new in zip(mine, theirs):
                row[:] = new
        self.model.groups[:] = totals.groups
        for cls, (reached, reused) in enumerate(zip(totals.reached, totals.reused)):
            if not reached[0] and any(reused):
                self.model.note_reuse_row(cls)
        self._base = GapCounts([list(r) for r in totals.reached], [list(r) for r in totals.reused], list(totals.groups))


def sync_all(syncs: list[GapSync], merge) -> GapCounts | None:
    """Send the summed deltas of `syncs` through `merge(delta) -> totals` (the predictor) and install the totals
    in each. None (nothing changes) when there is nothing to sync."""
    if not syncs:
        return None
    delta = syncs[0].delta()
    for s in syncs[1:]:
        delta.add(s.delta())
    totals = merge(delta)
    for s in syncs:
        s.install(totals)
    return totals
