"""`oracle-informed`: what an online predictor could at best learn of a trace timed by the loader's clock.

With random think times (kvcluster/traces/text.py, `TraceClock`) Belady knows the
exact moment each session returns; no online policy can, since each wait is a
fresh draw. What a predictor could learn, given all the data it wants, is the
distribution the draws come from and, at best, whether a conversation goes on.
This oracle is `bayes` told exactly that and nothing more:

- per request, whether its session has turns left (from the trace, in advance:
  the count of remaining turns beyond one does not matter here, since the next
  request takes the blocks into a group of its own);
- the think-time distribution of the clock (the fitted log-normal, or the fixed
  clock's one gap), as the hazard of reuse by age of every request group whose
  session comes back: P(next request in age bin k | not before it);
- not the draws: a group's rank follows its age, never its true next use.

The groups of sessions that end, and shared prefixes, keep what `bayes` learns of
them online (reuse by other sessions). Hit densities, horizon, candidates and
eviction order are `bayes`'s own, so the gap between it and `bayes` is what the
classes and hazards `bayes` learns miss of what is knowable, and the gap between
it and `oracle-next` (which knows the draws) is what no online policy can close.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

from kvcluster.policies.base import RequestContext
from kvcluster.policies.bayes import BayesPolicy
from kvcluster.reuse_gap import GapModel, age_bin
from kvcluster.traces import TraceClock
from kvcluster.traces.text import THINK_TIME_LOG_MU, THINK_TIME_LOG_SIGMA, TURN_GAP_S

ENDS, RETURNS, SHARED = 0, 1, 2  # the oracle's classes


def think_time_cdf(clock: TraceClock) -> Callable[[float], float]:
    """P(think time <= t) under `clock`: the fitted log-normal, or a step at the fixed clock's gap."""
    if clock.fixed:
        return lambda t: 1.0 if t >= TURN_GAP_S else 0.0
    scale = THINK_TIME_LOG_SIGMA * math.sqrt(2.0)
    return lambda t: 0.0 if t <= 0 else 0.5 * math.erfc(-(math.log(t) - THINK_TIME_LOG_MU) / scale)


def bin_hazards(cdf: Callable[[float], float], edges: list[float]) -> list[float]:
    """Per age bin (bin k spans edges[k] to edges[k + 1], the last is open), P(the wait ends in it | not before)."""
    out = []
    for k, lo in enumerate(edges):
        left = 1.0 - cdf(lo)
        ended = (cdf(edges[k + 1]) if k + 1 < len(edges) else 1.0) - cdf(lo)
        out.append(1.0 if left <= 1e-12 else min(1.0, ended / left))
    return out


def sessions_returning(sessions: tuple[str, ...]) -> list[bool]:
    """Per request, whether a later request of its session follows it."""
    out, seen = [False] * len(sessions), set()
    for i in range(len(sessions) - 1, -1, -1):
        out[i] = sessions[i] in seen
        seen.add(sessions[i])
    return out


class OracleInformed(BayesPolicy):
    """`bayes` whose classes are "its session returns" / "it ends" (plus shared prefixes), the returning class's
    hazard the clock's think-time distribution by age instead of a learnt one."""

    name = "oracle-informed"
    offline = True
    returns: list[bool] = []  # set per trace: `sessions_returning`
    cdf: Callable[[float], float] = staticmethod(think_time_cdf(TraceClock()))  # set per trace: `think_time_cdf`

    def __init__(self, capacity: int, **options) -> None:
        super().__init__(capacity, **options)
        self._shared_class = SHARED
        self.model = GapModel(3, self.model.config)
        self._queues = [deque() for _ in range(3)]
        self._known = bin_hazards(type(self).cdf, self.model.edges)
        self._hazards = self.model.all_hazards()
        self._hazards[RETURNS] = self._known
        self._dens = self.model.densities(self._lastbin, self._hazards)

    def _session_class(self, ctx: RequestContext, remember: bool) -> int:
        return RETURNS if self.returns[ctx.index] else ENDS

    def _refresh(self) -> None:
        super()._refresh()
        hazards = list(self._hazards)
        hazards[RETURNS] = self._known
        self._hazards = hazards
        self._dens = self.model.densities(age_bin(self.horizon_s, self._base, self._lastbin), hazards)
