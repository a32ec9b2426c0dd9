"""The Grafana dashboard queries only metrics kvcluster defines."""

import json
import re
from pathlib import Path

import kvcluster.actors.metrics as m

ROOT = Path(__file__).resolve().parents[1]


def test_every_dashboard_query_uses_a_defined_metric():
    dash = json.loads((ROOT / "configs" / "grafana" / "kvcluster-dashboard.json").read_text())
    defined = {f"ray_{getattr(m, f)().info['name']}" for f in ("tier_bytes", "tier_lookups", "bytes_moved", "evictions",
                                                              "prefetches", "posterior_mean", "ttft", "cached_tokens",
                                                              "requests", "faults", "belady_gap", "control_tracked")}
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"ray_kvcluster_[a-z_]+", target["expr"]):
                used.add(re.sub(r"_(total|bucket|sum|count)$", "", name))
    assert used and used <= defined, used - defined
    assert defined - used == set(), f"metrics without a panel: {defined - used}"


def test_kept_gauges_record_their_last_values_again():
    """Ray forgets a gauge series not recorded within an export interval: the keeper re-records each one."""
    calls = []

    class FakeGauge:
        info = {"name": "fake"}

        def set(self, value, tags=None):
            calls.append((value, tags))

    kept = m.KeptGauge(FakeGauge())
    kept.set(0.25, {"tier": "dram", "node": "n0"})
    kept.set(0.5, {"node": "n0", "tier": "dram"})  # same series, tags in another order
    kept.set(1.0, {"tier": "pfs", "node": "n0"})
    calls.clear()
    kept.refresh()
    assert sorted(calls, key=lambda c: c[0]) == [(0.5, {"node": "n0", "tier": "dram"}), (1.0, {"node": "n0", "tier": "pfs"})]
    assert kept.value({"tier": "dram", "node": "n0"}) == 0.5 and kept.info == {"name": "fake"}
    assert m.KeptGauge._thread is not None and m.KeptGauge._thread.daemon
