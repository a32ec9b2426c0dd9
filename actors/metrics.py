"""kvcluster's metrics, through `ray.util.metrics`: the Ray dashboard and Prometheus see them.

Names carry a `kvcluster_` prefix (Ray adds `ray_` on export). One process-wide
instance per metric, created on first use; every record is one call with tags,
so the request path adds no remote calls. Grafana: `configs/grafana/kvcluster-dashboard.json`.
"""

from __future__ import annotations

import os
import threading
import time
from functools import lru_cache

from ray.util.metrics import Counter, Gauge, Histogram

TTFT_BOUNDS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
TOKEN_BOUNDS = [1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 32768]


class KeptGauge:
    """A Gauge whose last value per tag set is recorded again every export interval.

    Why: Ray's OpenTelemetry recorder (2.50+) forgets at each export every gauge series
    not recorded during that interval (ray-project/ray#56405: it trusts live processes
    to report each interval), so a gauge set once, e.g. a posterior mean at predictor
    start or a tier's bytes while the tier is idle, vanishes from /metrics a few
    seconds later. One daemon thread per process re-records the kept values.
    """

    _all: list["KeptGauge"] = []
    _lock = threading.Lock()
    _thread: threading.Thread | None = None

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self._last: dict[tuple, float] = {}
        with KeptGauge._lock:
            KeptGauge._all.append(self)
            if KeptGauge._thread is None:
                KeptGauge._thread = threading.Thread(target=KeptGauge._keep, name="kvc-gauges", daemon=True)
                KeptGauge._thread.start()

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.gauge.set(value, tags)
        with KeptGauge._lock:
            self._last[tuple(sorted((tags or {}).items()))] = value

    @property
    def info(self) -> dict:
        """The wrapped gauge's name, description and tag keys."""
        return self.gauge.info

    def value(self, tags: dict[str, str]) -> float | None:
        """The last value set for `tags` (None if never set in this process)."""
        return self._last.get(tuple(sorted(tags.items())))

    def refresh(self) -> None:
        with KeptGauge._lock:
            kept = list(self._last.items())
        for key, value in kept:
            self.gauge.set(value, dict(key))

    @staticmethod
    def _keep() -> None:
        period = max(0.25, _report_interval_s() / 2)
        while True:
            time.sleep(period)
            for g in list(KeptGauge._all):
                try:
                    g.refresh()
                except Exception:  # noqa: BLE001 - a metrics hiccup must never kill the keeper
                    pass


def _report_interval_s() -> float:
    """Ray's metrics export interval (RAY_metrics_report_interval_ms, default 10 s)."""
    try:
        import ray

        return ray._config.metrics_report_interval_ms() / 1000.0
    except Exception:  # noqa: BLE001 - private API: fall back to the environment, then Ray's default
        return float(os.environ.get("RAY_metrics_report_interval_ms", 10_000)) / 1000.0


@lru_cache(maxsize=None)
def tier_bytes() -> KeptGauge:
    return KeptGauge(Gauge("kvcluster_tier_bytes", "Bytes a tier holds (kind=used) and can hold (kind=capacity).",
                           tag_keys=("node", "tier", "kind")))


@lru_cache(maxsize=None)
def tier_lookups() -> Counter:
    return Counter("kvcluster_tier_lookups", "Block reads per tier by outcome (hit, miss, corrupt).",
                   tag_keys=("node", "tier", "outcome"))


@lru_cache(maxsize=None)
def bytes_moved() -> Counter:
    return Counter("kvcluster_bytes_moved", "Block bytes moved (src -> dst). how: promote, a tier's blocks read "
                   "into a replica's hbm; commit, blocks a replica computed sent to the control plane; and the "
                   "control plane's moves: store, demote, promote, migrate (between nodes).",
                   tag_keys=("src", "dst", "how"))


@lru_cache(maxsize=None)
def evictions() -> Counter:
    return Counter("kvcluster_evictions", "Blocks leaving a tier by policy decision (unit=block), and the head "
                   "shards they take with them (unit=head_shard: kv heads per block, 1 for an MLA latent; the live "
                   "path evicts whole blocks, so shards leave with their block).",
                   tag_keys=("node", "tier", "unit"))


@lru_cache(maxsize=None)
def prefetches() -> Counter:
    return Counter("kvcluster_prefetch", "Blocks a tier stored as promoted ahead of use (a put or pull with "
                   "prefetch=True), settled as hit (read before leaving the tier) or wasted (deleted unread).",
                   tag_keys=("outcome",))


@lru_cache(maxsize=None)
def queued_prefetches() -> Counter:
    return Counter("kvcluster_queued_prefetch_requests", "Requests that waited for a replica slot and had their "
                   "cached prefix lifted into their node's first tier meanwhile.", tag_keys=("node",))


@lru_cache(maxsize=None)
def posterior_mean() -> KeptGauge:
    return KeptGauge(Gauge("kvcluster_predictor_posterior_mean", "Mean of the Beta posterior of P(reuse) per pair.",
                           tag_keys=("block_type", "transition")))


@lru_cache(maxsize=None)
def control_tracked() -> KeptGauge:
    """What a node's cache manager keeps beyond the bytes: bounded by its tiers, not by what it ever met."""
    return KeptGauge(Gauge("kvcluster_control_tracked", "Bookkeeping of the control plane per node: block keys it "
                           "tracks (kind=keys: resident, or remembered by a tier's policy) and sessions its policy "
                           "remembers (kind=sessions).", tag_keys=("node", "kind")))


@lru_cache(maxsize=None)
def belady_gap() -> KeptGauge:
    """Belady's hit rate minus the tier policy's, over the replica's recent requests (kvcluster.belady_gap)."""
    return KeptGauge(Gauge("kvcluster_belady_gap", "Estimated hit-rate gap to Belady over the recent window, per "
                           "tier, of the policy the cluster runs.", tag_keys=("node", "tier", "policy")))


@lru_cache(maxsize=None)
def ttft() -> Histogram:
    return Histogram("kvcluster_ttft_seconds", "Time to first token per request (replica side).",
                     boundaries=TTFT_BOUNDS_S, tag_keys=("model",))


@lru_cache(maxsize=None)
def cached_tokens() -> Histogram:
    return Histogram("kvcluster_cached_tokens", "Prompt tokens served from the cache per request.",
                     boundaries=TOKEN_BOUNDS, tag_keys=("model",))


@lru_cache(maxsize=None)
def requests() -> Counter:
    return Counter("kvcluster_requests", "Requests by endpoint and HTTP status.", tag_keys=("endpoint", "status"))


@lru_cache(maxsize=None)
def faults() -> Counter:
    return Counter("kvcluster_faults", "Faults absorbed as misses (kind: actor_unavailable, corrupt, put_refused, "
                   "index_unavailable, stream_failed).", tag_keys=("component", "kind"))


def publish_posteriors(snapshot) -> None:
    """A predictor snapshot's posterior means, one gauge value per (block type, transition)."""
    from kvcluster.block_types import BlockType, TransitionType, pair_index

    gauge = posterior_mean()
    for bt in BlockType:
        for tr in TransitionType:
            i = pair_index(bt, tr)
            gauge.set(snapshot.alpha[i] / (snapshot.alpha[i] + snapshot.beta[i]),
                      {"block_type": bt.name.lower(), "transition": tr.name.lower()})
