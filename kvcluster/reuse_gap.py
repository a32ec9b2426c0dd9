"""Time to next use: a Bayesian hazard over log-spaced reuse-gap bins, per block class.

Whether a block comes back is not enough to rank it; Belady wins by knowing
*when*. For every class of block (see `BlockClasses`) this keeps, per age bin k
(bin 0 is [0, base), bin k >= 1 is [base 2^(k-1), base 2^k) seconds):

- `reached[c][k]`: blocks of class c that stayed unused up to the start of bin k,
- `reused[c][k]`: of those, the ones used again while their age was in bin k.

The hazard h = P(used again in bin k | unused until bin k) has a Beta posterior
whose prior is the pooled hazard of all classes at that bin, so a rare class
borrows from the common ones and a new class starts from the population. Counts
are updated in O(1) per reuse and per bin crossing of a whole request group,
never per block per bin.

The blocks of one request are used again together, so a thousand of them are
one observation of when that request's session comes back, not a thousand: the
evidence a class holds is its number of groups (`groups[c]`, a count per use of a
group). The prior therefore weighs `prior_weight` groups of the class's mean
size, which leaves a class's block-weighted estimate as it is but shrinks it
towards the population as much as its few groups warrant (the design effect of
cluster sampling). Counted per block instead, a handful of very large groups
pinned the hazard of a rare class at ages nobody else had reached.

From the hazards follow, for a block of class c at age a: P(reuse within t),
the expected time it occupies the cache, and the LHD hit density (Beckmann et
al., NSDI '18): expected hits over the expected cache time they cost, with the
block's life cut at a horizon that tracks how long blocks actually stay.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class GapModelConfig(BaseModel):
    """Bins and prior of the reuse-gap model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_s: float = Field(0.5, gt=0, description="Upper edge of the first age bin; each later bin doubles.")
    bins: int = Field(22, ge=4, le=40, description="Number of age bins (the last one is open-ended).")
    prior_weight: float = Field(4.0, gt=0, description="Pseudo-observations of the pooled hazard in every class, "
                                "each a group of the class's mean size.")


def age_bin(age: float, base: float, last: int) -> int:
    """Bin of an age in seconds: 0 below `base`, then one bin per doubling, capped at `last`."""
    if age < base:
        return 0
    k = int(age / base).bit_length()
    return k if k < last else last


class GapModel:
    """Per-class hazard of reuse by age bin, with a pooled Beta prior."""

    def __init__(self, classes: int, config: GapModelConfig | None = None) -> None:
        self.config = config or GapModelConfig()
        self.classes = classes
        k = self.config.bins
        self.base = self.config.base_s
        self.edges = [0.0] + [self.base * 2 ** (i - 1) for i in range(1, k)]
        self.widths = [self.edges[i + 1] - self.edges[i] for i in range(k - 1)] + [self.edges[-1]]
        self._widths = np.array(self.widths)
        self.reached = [[0.0] * k for _ in range(classes)]
        self.reused = [[0.0] * k for _ in range(classes)]
        self.groups = [0.0] * classes  # groups of blocks used together, per class; 0: counted block by block
        self._reuse_only: set[int] = set()  # see `note_reuse_row`
        self._horizon_ends: dict[int, np.ndarray] = {}  # horizon bin -> the bin each age's life is cut after

    def hazards(self, cls: int) -> list[float]:
        """Posterior mean hazard per bin for one class, shrunk to the pooled hazard."""
        return self.all_hazards()[cls]

    def _pooled_from(self, reached: list[float], reused: list[float]) -> list[float]:
        """Hazard of all classes together per bin, from the per-bin totals; a bin with little data leans on the
        bin before it.

        The prior of bin k is one pseudo-observation of bin k-1's pooled hazard, so an age nobody
        (or hardly anybody) has reached yet carries on the hazard seen just before, instead of a
        flat 0.5 that would make very old blocks look valuable. Bin 0's prior is the hazard that
        spreads even odds of ever coming back evenly over all bins. Counts are whole numbers: any
        order of adding them is exact."""
        out, prev = [], 1.0 - 0.5 ** (1.0 / self.config.bins)
        for n, hits in zip(reached, reused):
            prev = (hits + prev) / (n + 1.0)
            out.append(prev)
        return out

    def note_reuse_row(self, cls: int) -> None:
        """Say that class `cls` may count reuses of blocks it never counted a use of (blocks admitted from below).

        Rows with uses are found by their first bin; these must be named, so that a
        refresh need not scan every row of reuses."""
        self._reuse_only.add(cls)

    def _seen_hazards(self) -> tuple[list[int], np.ndarray]:
        """The classes with counts and their posterior hazards, the pooled hazard first (row 0)."""
        w, k = self.config.prior_weight, self.config.bins
        # only the rows with counts go through numpy: most classes of a trace never occur
        seen = [c for c, row in enumerate(self.reached) if row[0]]
        reused_only = [self.reused[c] for c in self._reuse_only if not self.reached[c][0]]
        reached = np.array([self.reached[c] for c in seen]).reshape(len(seen), k)
        groups = self.groups
        # the prior weighs w groups of the class's mean size (blocks counted one by one: groups of 1)
        w = w * np.array([self.reached[c][0] / groups[c] if groups[c] else 1.0 for c in seen]).reshape(len(seen), 1)
        reused_seen = np.array([self.reused[c] for c in seen]).reshape(len(seen), k)
        reused_all = reused_seen.sum(axis=0)
        if reused_only:
            reused_all = reused_all + np.array(reused_only).sum(axis=0)
        pooled = np.array(self._pooled_from(reached.sum(axis=0).tolist(), reused_all.tolist()))
        return seen, np.vstack([pooled, np.minimum(1.0, (reused_seen + w * pooled) / (reached + w))])

    def _per_class(self, seen: list[int], rows: list[list[float]]) -> list[list[float]]:
        """One row per class from `_seen_hazards`' layout: classes never seen share row 0."""
        out = [rows[0]] * self.classes
        for i, cls in enumerate(seen, 1):
            out[cls] = rows[i]
        return out

    def all_hazards(self) -> list[list[float]]:
        """Hazards of every class; classes never seen share one row (the pooled hazard)."""
        seen, h = self._seen_hazards()
        return self._per_class(seen, h.tolist())

    def hazards_and_densities(self, horizon_bin: int) -> tuple[list[list[float]], list[list[float]]]:
        """`all_hazards()` and `densities(horizon_bin)` of them, computed together (a policy's refresh)."""
        seen, h = self._seen_hazards()
        return self._per_class(seen, h.tolist()), self._per_class(seen, self._density_rows(h, horizon_bin).tolist())

    def p_reuse_within(self, cls: int, age: float, t: float, hazards: list[float] | None = None) -> float:
        """P(used again before age + t | unused until age), from the bin hazards.

        Bins partly inside (age, age + t] count in proportion to the part inside
        (a constant hazard rate within a bin)."""
        h = hazards if hazards is not None else self.hazards(cls)
        last = self.config.bins - 1
        end = age + t
        survive = 1.0
        k = age_bin(age, self.base, last)
        while True:
            lo = self.edges[k]
            hi = self.edges[k + 1] if k < last else float("inf")
            if k == last:
                frac = 1.0 if end >= hi else min(1.0, (end - max(lo, age)) / max(self.widths[k], 1e-9))
            else:
                frac = (min(hi, end) - max(lo, age)) / (hi - max(lo, age)) if hi > max(lo, age) else 1.0
            survive *= 1.0 - h[k] * max(0.0, min(1.0, frac))
            if end <= hi or k == last:
                break
            k += 1
        return 1.0 - survive

    def densities(self, horizon_bin: int, hazards: list[list[float]] | None = None) -> list[list[float]]:
        """Hit density per class and age bin: expected reuses before the horizon per second held.

        Held from the start of bin k until reused or until the end of bin
        max(k, horizon_bin). Computed once per distinct row (classes with no data
        share the pooled row)."""
        hs = hazards if hazards is not None else self.all_hazards()
        distinct: dict[int, int] = {}
        rows: list[list[float]] = []
        for h in hs:
            if id(h) not in distinct:
                distinct[id(h)] = len(rows)
                rows.append(h)
        dens = self._density_rows(np.array(rows), horizon_bin).tolist()
        return [dens[distinct[id(h)]] for h in hs]

    def _density_rows(self, h: np.ndarray, horizon_bin: int) -> np.ndarray:
        """`densities` of the hazard rows `h`: suffix sums over all rows at once, in the order a per-bin loop
        adds them."""
        k_bins = self.config.bins
        n = h.shape[0]
        surv = np.ones((n, k_bins))  # survival to the start of each bin
        np.cumprod(1.0 - h[:, :-1], axis=1, out=surv[:, 1:])
        # suffix sums from the last bin down (one trailing zero column); a block reused within bin i holds half
        # the bin on average
        used = surv * h
        hits = np.zeros((n, k_bins + 1))
        np.cumsum(used[:, ::-1], axis=1, out=hits[:, k_bins - 1::-1])
        time = np.zeros((n, k_bins + 1))
        held = surv * self._widths * (1.0 - 0.5 * h)
        np.cumsum(held[:, ::-1], axis=1, out=time[:, k_bins - 1::-1])
        ends = self._horizon_ends.get(horizon_bin)
        if ends is None:
            ends = self._horizon_ends[horizon_bin] = np.minimum(np.maximum(np.arange(k_bins), horizon_bin) + 1, k_bins)
        num = hits[:, :k_bins] - hits[:, ends]
        den = time[:, :k_bins] - time[:, ends]
        return np.divide(num, den, out=np.zeros_like(num), where=den > 0)
