"""The Grafana dashboard queries only metrics kvcluster defines."""

import json
import re
from pathlib import Path

import actors.metrics as m

ROOT = Path(__file__).resolve().parents[1]


def test_every_dashboard_query_uses_a_defined_metric():
    dash = json.loads((ROOT / "configs" / "grafana" / "kvcluster-dashboard.json").read_text())
    defined = {f"ray_{getattr(m, f)().info['name']}" for f in ("tier_bytes", "tier_lookups", "bytes_moved", "evictions",
                                                              "prefetches", "posterior_mean", "ttft", "cached_tokens",
                                                              "requests", "faults", "belady_gap")}
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"ray_kvcluster_[a-z_]+", target["expr"]):
                used.add(re.sub(r"_(total|bucket|sum|count)$", "", name))
    assert used and used <= defined, used - defined
    assert defined - used == set(), f"metrics without a panel: {defined - used}"
