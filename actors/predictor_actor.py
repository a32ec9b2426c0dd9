"""The global reuse predictor as a detached, named Ray actor.

Replicas and tier actors send access events in batches and read versioned
snapshots (P(reuse) lookups then happen locally, never as a remote call). The
posteriors are checkpointed as JSON to a directory on the shared filesystem
(temp file + rename) and restored when the actor restarts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray

from kvcluster.gap_sync import GapCounts
from kvcluster.predictor import PredictorConfig, PredictorSnapshot, ReusePredictor

from . import metrics

PREDICTOR_NAME = "kvcluster/predictor"


@ray.remote(num_cpus=0, max_restarts=-1)
class PredictorActor:
    def __init__(self, checkpoint_dir: str, config: dict | None = None, checkpoint_every: int = 16) -> None:
        self.predictor = ReusePredictor(PredictorConfig.model_validate(config or {}))
        self.path = Path(checkpoint_dir) / "predictor.json"
        self.every = checkpoint_every
        self._batches = 0
        if ray.get_runtime_context().was_current_actor_reconstructed:
            metrics.faults().inc(1, {"component": "predictor", "kind": "restarted"})
        self.gap: GapCounts | None = None  # the cluster's reuse-gap counts (kvcluster.gap_sync), once sent
        if self.path.is_file():
            raw = json.loads(self.path.read_text())
            self.predictor.restore(PredictorSnapshot(raw["version"], tuple(raw["alpha"]), tuple(raw["beta"])))
            if raw.get("gap"):
                self.gap = GapCounts.from_dict(raw["gap"])
        self._publish()  # the dashboard shows the prior (or the restored posteriors) from the start

    def observe(self, keys: list[bytes], pairs: list[int], now: float) -> int:
        """One request's (or one tier's) access events; returns the snapshot version after them."""
        self.predictor.observe_many(keys, pairs, now)
        self._batches += 1
        if self._batches % self.every == 0:
            self.checkpoint()
        self._publish()
        return self.predictor.version

    def _publish(self) -> None:
        """Posterior means as gauges (kept: re-recorded every export interval until the next change)."""
        metrics.publish_posteriors(self.predictor.snapshot())

    def merge_gap(self, delta: GapCounts) -> GapCounts:
        """A control plane's reuse-gap counts since its last sync, added to the cluster's; returns the totals.
        Counts of another shape (a changed bin layout) start the totals afresh."""
        if self.gap is None or self.gap.shape != delta.shape:
            self.gap = GapCounts.zeros(*delta.shape)
        self.gap.add(delta)
        return self.gap

    def gap_totals(self) -> GapCounts | None:
        return self.gap

    def snapshot(self) -> PredictorSnapshot:
        return self.predictor.snapshot()

    def checkpoint(self) -> int:
        snap = self.predictor.snapshot()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": snap.version, "alpha": snap.alpha, "beta": snap.beta,
                                   "gap": self.gap.to_dict() if self.gap is not None else None}))
        os.replace(tmp, self.path)
        return snap.version
