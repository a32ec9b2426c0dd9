"""Calibration of the reuse-gap predictor on a trace: Brier score and a reliability table.

Every block reference gets the predictor's P(used again within t) from what was
learnt before it (the `bayes` policy's hazards, updated online as the trace
plays), and the trace then says whether it was. A predictor that says 0.3
should be right about 30% of the time: the reliability table bins the
predictions by decile and sets the mean prediction of each bin against the
share that came true.
"""

from __future__ import annotations

from .policies.bayes import BayesPolicy
from .simulator import PreparedTrace, request_context


def calibrate(trace: PreparedTrace, horizon_s: float = 60.0) -> dict:
    """Brier score and per-decile reliability of P(reuse within `horizon_s`), scored on every reference."""
    if horizon_s <= 0:
        raise ValueError("horizon_s must be > 0")
    next_time: list[list[float]] = [[] for _ in trace.blocks]
    last: dict[int, float] = {}
    inf = float("inf")
    for i in range(len(trace.blocks) - 1, -1, -1):
        t = trace.arrivals[i]
        next_time[i] = [last.get(b, inf) - t for b in trace.blocks[i]]
        for b in trace.blocks[i]:
            last[b] = t
    policy = BayesPolicy(capacity=trace.unique_blocks)  # only its learning matters here
    sums = [[0, 0.0, 0] for _ in range(10)]  # per decile: count, summed prediction, came true
    brier = base = 0.0
    n = 0
    for i, blocks in enumerate(trace.blocks):
        ctx = request_context(trace, i)
        for p, gap in zip(policy.predict_within(blocks, ctx, horizon_s), next_time[i]):
            y = 1 if gap <= horizon_s else 0
            brier += (p - y) ** 2
            base += y
            row = sums[min(9, int(p * 10))]
            row[0] += 1
            row[1] += p
            row[2] += y
            n += 1
        policy.access(blocks, ctx)
    rate = base / max(1, n)
    return {
        "horizon_s": horizon_s,
        "references": n,
        "brier": brier / max(1, n),
        "brier_base_rate": rate * (1 - rate),  # what always predicting the overall rate would score
        "reliability": [
            {"decile": f"{d / 10:.1f}-{(d + 1) / 10:.1f}", "count": c, "predicted": s / c, "observed": y / c}
            for d, (c, s, y) in enumerate(sums) if c
        ],
    }
