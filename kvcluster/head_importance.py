"""EMA of how much attention each KV head's cache receives.

Fed the attention mass each head put on cached tokens (summed over query
positions and layers), or a fixed profile where no attention is seen (the
simulator). Scores are normalised so the most important head scores 1.0 and the
`bayes` policy evicts low-score shards first. The live serving path does not
evict head shards: a block missing one head's KV cannot be completed without
recomputing the whole block, so exact output needs whole blocks.
"""

from __future__ import annotations

from typing import Sequence


class HeadImportance:
    def __init__(self, heads: int, decay: float = 0.9, initial: Sequence[float] | None = None) -> None:
        if heads < 1 or not 0 <= decay < 1:
            raise ValueError("heads must be >= 1 and decay in [0, 1)")
        if initial is not None and len(initial) != heads:
            raise ValueError(f"initial profile needs {heads} values")
        self.decay = decay
        self._ema = [float(x) for x in (initial or [1.0] * heads)]

    def update(self, attention_mass: Sequence[float]) -> None:
        """Blend one observation (one non-negative value per head) into the EMA."""
        if len(attention_mass) != len(self._ema):
            raise ValueError(f"expected {len(self._ema)} head values, got {len(attention_mass)}")
        d = self.decay
        self._ema = [d * old + (1 - d) * max(0.0, float(new)) for old, new in zip(self._ema, attention_mass)]

    def scores(self) -> tuple[float, ...]:
        top = max(self._ema)
        if top <= 0:
            return tuple(1.0 for _ in self._ema)
        return tuple(max(x / top, 1e-6) for x in self._ema)
