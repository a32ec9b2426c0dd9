"""Bayesian reuse predictor: a Beta posterior per (block type, transition) pair.

A block starts a watch when it is stored or used. Used again before its horizon
ends: a success for the pair it was stored under. Horizon passed unused: a
failure. P(reuse) is the posterior mean, O(1). Deadlines are kept in arrival
order (the horizon is fixed and the clock only moves forward), so expiry is
amortised O(1) per event.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .block_types import NUM_PAIRS, BlockType, TransitionType, pair_index


class PredictorConfig(BaseModel):
    """Priors and horizon of the reuse predictor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prior_alpha: float = Field(1.0, gt=0, description="Beta prior successes for every pair.")
    prior_beta: float = Field(1.0, gt=0, description="Beta prior failures for every pair.")
    horizon_s: float = Field(120.0, gt=0, description="A reuse counts only within this many seconds.")
    prior_strength: float = Field(
        2.0, gt=0, description="Weight of the pair posterior against a block's own reuse record."
    )
    pair_priors: dict[str, tuple[float, float]] = Field(
        default_factory=dict,
        description="Per-pair (alpha, beta) overrides keyed '<block type>/<transition>': block types system, "
        "history, tool, output; transitions first, append, fork, agent_step (e.g. 'system/append').",
    )

    @field_validator("pair_priors")
    @classmethod
    def _known_pairs(cls, priors: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        """A misspelt pair would silently keep the default prior: name the valid ones instead."""
        valid = {f"{b.name.lower()}/{t.name.lower()}" for b in BlockType for t in TransitionType}
        for key, (alpha, beta) in priors.items():
            if key not in valid:
                raise ValueError(f"unknown pair {key!r}; pairs are <block type>/<transition>, e.g. "
                                 f"{', '.join(sorted(valid)[:3])}, ...")
            if alpha <= 0 or beta <= 0:
                raise ValueError(f"pair {key!r}: alpha and beta must be positive, got ({alpha}, {beta})")
        return priors

    def prior(self, index: int) -> tuple[float, float]:
        block_type, transition = divmod(index, len(TransitionType))
        key = f"{BlockType(block_type).name.lower()}/{TransitionType(transition).name.lower()}"
        return self.pair_priors.get(key, (self.prior_alpha, self.prior_beta))


@dataclass(frozen=True)
class PredictorSnapshot:
    """Versioned posterior state, cheap to ship to replicas and tier actors."""

    version: int
    alpha: tuple[float, ...]
    beta: tuple[float, ...]

    def p_reuse(self, pair: int) -> float:
        return self.alpha[pair] / (self.alpha[pair] + self.beta[pair])


class ReusePredictor:
    """Learns P(reuse within horizon) per pair, and per block on top of it.

    Pair level: Beta(alpha, beta) per (block type, transition). Block level: a
    block under watch also keeps its own reuse record, and its P(reuse) is the
    hierarchical posterior mean (k * p_pair + reuses) / (k + uses) with
    k = prior_strength. A block whose watch expires forgets its record, so memory
    is bounded by the blocks seen within one horizon.
    """

    def __init__(self, config: PredictorConfig | None = None) -> None:
        self.config = config or PredictorConfig()
        priors = [self.config.prior(i) for i in range(NUM_PAIRS)]
        self.alpha = [a for a, _ in priors]
        self.beta = [b for _, b in priors]
        self.version = 0
        self._rec: dict[int, list] = {}  # block -> [pair, deadline, reuses, uses]
        self._deadlines: deque[tuple[float, Sequence[int]]] = deque()  # (deadline, blocks), one per call

    def p_reuse(self, block_type: int, transition: int) -> float:
        return self.p_reuse_pair(pair_index(block_type, transition))

    def p_reuse_pair(self, pair: int) -> float:
        return self.alpha[pair] / (self.alpha[pair] + self.beta[pair])

    def p_block(self, block: int, pair: int) -> float:
        """P(reuse) of one block: its own record shrunk towards its pair's posterior."""
        k = self.config.prior_strength
        rec = self._rec.get(block)
        reuses, uses = (rec[2], rec[3]) if rec else (0, 0)
        return (k * self.p_reuse_pair(pair) + reuses) / (k + uses)

    def pair_of(self, block: int, default: int) -> int:
        """The pair a watched block was last used under, else `default`."""
        rec = self._rec.get(block)
        return rec[0] if rec else default

    def observe(self, block: int, pair: int, now: float) -> bool:
        """A block was used (or stored) at `now`; True if this was a counted reuse."""
        self.expire(now)
        reused = block in self._rec
        self.observe_many((block,), (pair,), now)
        return reused

    def observe_many(self, blocks: Sequence[int], pairs: Sequence[int], now: float) -> list[float]:
        """Record uses of `blocks` at `now`; returns each block's P(reuse) afterwards.

        One call per request: this is the hot path of every replay and every
        live lookup, so it works on local aliases only.
        """
        self.expire(now)
        rec_get, recs, alpha, beta = self._rec.get, self._rec, self.alpha, self.beta
        k = self.config.prior_strength
        deadline = now + self.config.horizon_s
        self._deadlines.append((deadline, blocks))
        out = [0.0] * len(blocks)
        successes = 0
        for j, block in enumerate(blocks):
            pair = pairs[j]
            rec = rec_get(block)
            if rec is None:
                rec = recs[block] = [pair, deadline, 0, 1]
            else:
                alpha[rec[0]] += 1.0
                successes += 1
                rec[0], rec[1] = pair, deadline
                rec[2] += 1
                rec[3] += 1
            a = alpha[pair]
            out[j] = (k * a / (a + beta[pair]) + rec[2]) / (k + rec[3])
        if successes:
            self.version += 1
        return out

    def watching(self, block: int) -> bool:
        """Whether a block's reuse record is open (its horizon has not ended)."""
        return block in self._rec

    def forget(self, block: int) -> None:
        """Stop watching a block (no outcome recorded)."""
        self._rec.pop(block, None)

    def expire(self, now: float) -> int:
        """Record a failure for every watch whose horizon ended before `now`."""
        expired = 0
        deadlines, recs = self._deadlines, self._rec
        while deadlines and deadlines[0][0] < now:
            deadline, blocks = deadlines.popleft()
            for block in blocks:
                rec = recs.get(block)
                if rec is not None and rec[1] == deadline:
                    del recs[block]
                    self.beta[rec[0]] += 1.0
                    expired += 1
        if expired:
            self.version += 1
        return expired

    def apply_counts(self, successes: Sequence[float], failures: Sequence[float]) -> None:
        """Merge outcome counts observed elsewhere (the live predictor actor's batches)."""
        for i in range(NUM_PAIRS):
            self.alpha[i] += successes[i]
            self.beta[i] += failures[i]
        self.version += 1

    def snapshot(self) -> PredictorSnapshot:
        return PredictorSnapshot(self.version, tuple(self.alpha), tuple(self.beta))

    def restore(self, snapshot: PredictorSnapshot) -> None:
        """Adopt a snapshot's posteriors (pending watches are kept)."""
        if len(snapshot.alpha) != NUM_PAIRS or len(snapshot.beta) != NUM_PAIRS:
            raise ValueError(f"snapshot must hold {NUM_PAIRS} pairs")
        self.alpha, self.beta = list(snapshot.alpha), list(snapshot.beta)
        self.version = snapshot.version

    def check_integrity(self) -> None:
        assert all(a > 0 for a in self.alpha) and all(b > 0 for b in self.beta)
        assert sum(len(b) for _, b in self._deadlines) >= len(self._rec)
        assert all(0 <= r[2] < r[3] for r in self._rec.values())
