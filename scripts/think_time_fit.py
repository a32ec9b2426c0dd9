"""Fit the think-time distribution that times the text traces (kvcluster/traces/text.py) to the Claude Code traces.

A think time is the gap from one request of a session to the session's next request. The Claude Code
session files (weka_claude_code_traces and weka_claude_code_traces_more under the shared data) give each
request its time `t` since the session started; the gaps are the differences of `t` between consecutive
top-level requests of one file (a sub-agent's requests run inside a parent turn and are left out). The fit
is a log-normal by maximum likelihood: MU and SIGMA are the mean and the population standard deviation of
ln(gap / 1 s). Printed: the fit, the measured and fitted quantiles, the Kolmogorov-Smirnov distance, the
constants text.py holds, and the same statistics split by how the previous request's answer ended
(`tool_use`: an agent step; `end_turn`: a person's turn), for reference.

    .venv/bin/python scripts/think_time_fit.py [--json]

The shared data folder is $KVCLUSTER_DATA, else ../shared/data beside the repository (kvcluster.paths).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from kvcluster.paths import shared_data_dir
from kvcluster.traces.text import THINK_TIME_LOG_MU, THINK_TIME_LOG_SIGMA

FOLDERS = ("weka_claude_code_traces", "weka_claude_code_traces_more")
QUANTILES = (0.10, 0.25, 0.50, 0.75, 0.90, 0.99)


def session_gaps(files: list[Path]) -> dict[str, list[float]]:
    """Gaps (s) between consecutive top-level requests of each session file, keyed by the earlier request's stop."""
    by_stop: dict[str, list[float]] = {}
    for f in files:
        doc = json.loads(f.read_text())
        top = [r for r in doc.get("requests", []) if isinstance(r, dict) and r.get("type") != "subagent"]
        for a, b in zip(top, top[1:]):
            by_stop.setdefault(str(a.get("stop") or ""), []).append(float(b["t"]) - float(a["t"]))
    return by_stop


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))


def fit(gaps: list[float]) -> dict:
    g = np.sort(np.asarray(gaps, dtype=float))
    if len(g) < 2 or g[0] <= 0:
        raise ValueError("a log-normal fit needs two or more gaps, all > 0")
    logs = np.log(g)
    mu, sigma = float(logs.mean()), float(logs.std())
    fitted = _normal_cdf((logs - mu) / sigma)
    n = len(g)
    ks = float(max(np.max(np.arange(1, n + 1) / n - fitted), np.max(fitted - np.arange(n) / n)))
    z = {0.10: -1.281552, 0.25: -0.674490, 0.50: 0.0, 0.75: 0.674490, 0.90: 1.281552, 0.99: 2.326348}
    return {"gaps": n, "mu": round(mu, 4), "sigma": round(sigma, 4), "median_s": round(math.exp(mu), 2),
            "ks_distance": round(ks, 4),
            "measured_quantiles_s": {f"{q:.0%}": round(float(np.quantile(g, q)), 1) for q in QUANTILES},
            "fitted_quantiles_s": {f"{q:.0%}": round(math.exp(mu + z[q] * sigma), 1) for q in QUANTILES}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    args = parser.parse_args()
    data = shared_data_dir()
    files = sorted(f for folder in FOLDERS for f in (data / folder).glob("*.json"))
    if not files:
        print(f"think_time_fit: no Claude Code session files under {data}/{{{','.join(FOLDERS)}}}", file=sys.stderr)
        return 2
    by_stop = session_gaps(files)
    report = {"sessions": len(files), "all": fit([g for gaps in by_stop.values() for g in gaps]),
              "by_previous_stop": {stop or "(none)": fit(gaps) for stop, gaps in sorted(by_stop.items())},
              "text_py": {"THINK_TIME_LOG_MU": THINK_TIME_LOG_MU, "THINK_TIME_LOG_SIGMA": THINK_TIME_LOG_SIGMA}}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['sessions']} Claude Code sessions")
    for label, r in [("all gaps", report["all"])] + [(f"after {k}", v) for k, v in report["by_previous_stop"].items()]:
        print(f"{label}: {r['gaps']:,} gaps, ln gap ~ N({r['mu']}, {r['sigma']}^2), median {r['median_s']} s, "
              f"KS {r['ks_distance']}")
        print("  quantile  " + "  ".join(f"{q:>7}" for q in r["measured_quantiles_s"]))
        print("  measured  " + "  ".join(f"{v:>7}" for v in r["measured_quantiles_s"].values()))
        print("  fitted    " + "  ".join(f"{v:>7}" for v in r["fitted_quantiles_s"].values()))
    same = (report["all"]["mu"], report["all"]["sigma"]) == (THINK_TIME_LOG_MU, THINK_TIME_LOG_SIGMA)
    print(f"text.py: THINK_TIME_LOG_MU = {THINK_TIME_LOG_MU}, THINK_TIME_LOG_SIGMA = {THINK_TIME_LOG_SIGMA} "
          f"({'the fit above' if same else 'NOT the fit above'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
