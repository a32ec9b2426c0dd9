"""One memory tier of one node as a Ray actor: it contains one storage backend.

Named `kvcluster/<node>/<tier>`, pinned to its node, restarted on failure. A
restart comes back empty for memory tiers (their blocks become misses, and the
index is told); the nvme and pfs tiers reopen their directory. Every put and
delete is reported to the index actor in one batched, fire-and-forget call.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import ray
from pydantic import BaseModel, ConfigDict, Field

from kvcluster.storage import NVMeBackend, PFSBackend, cxl_backend, dram_backend

from .index_actor import INDEX_NAME, NAMESPACE


class TierActorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str = Field(description="Node name used in actor names and the index.")
    tier: str = Field(pattern="^(dram|cxl|nvme|pfs)$", description="hbm stays inside the model replica.")
    slots: int = Field(gt=0, description="Blocks the tier holds (pfs: capacity in blocks).")
    slot_bytes: int = Field(gt=0, description="Bytes per block payload.")
    path: str | None = Field(None, description="Directory for nvme and pfs.")


def actor_name(node: str, tier: str) -> str:
    return f"kvcluster/{node}/{tier}"


def _backend(cfg: TierActorConfig):
    if cfg.tier == "dram":
        return dram_backend(cfg.slots, cfg.slot_bytes)
    if cfg.tier == "cxl":
        return cxl_backend(cfg.slots, cfg.slot_bytes)
    if cfg.path is None:
        raise ValueError(f"the {cfg.tier} tier needs a path")
    if cfg.tier == "nvme":
        return NVMeBackend(Path(cfg.path) / cfg.node, cfg.slots, cfg.slot_bytes)
    return PFSBackend(cfg.path, cfg.slots * cfg.slot_bytes)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class TierActor:
    def __init__(self, config: dict) -> None:
        self.cfg = TierActorConfig.model_validate(config)
        self.backend = _backend(self.cfg)
        self.index = ray.get_actor(INDEX_NAME, namespace=NAMESPACE)
        if self.cfg.tier != "pfs":  # a fresh process holds nothing: what the index thought it had is gone
            self.index.lost.remote(self.cfg.node, self.cfg.tier)

    def put_many(self, keys: list[bytes], payloads: list[np.ndarray], pairs: list[int] | None = None) -> list[bool]:
        ok = self.backend.put_many(list(zip(keys, payloads)))
        stored = [k for k, good in zip(keys, ok) if good]
        if stored:
            kept = None if pairs is None else [p for p, good in zip(pairs, ok) if good]
            self.index.stored.remote(self.cfg.node, self.cfg.tier, stored, kept)
        return ok

    def get_many(self, keys: list[bytes]) -> list[np.ndarray | None]:
        got = self.backend.get_many(keys)
        bad = [k for k, g in zip(keys, got) if g is None]
        if bad:  # missing or corrupt here: make sure nobody is sent here for it again
            self.index.removed.remote(self.cfg.node, self.cfg.tier, bad)
        return got

    def delete(self, keys: list[bytes]) -> int:
        n = self.backend.delete(keys)
        self.index.removed.remote(self.cfg.node, self.cfg.tier, keys)
        return n

    def stats(self) -> dict:
        return self.backend.stats()

    def describe(self) -> dict:
        """Where this tier is and how many blocks it can hold (the placement controller's capacity)."""
        return {"node": self.cfg.node, "tier": self.cfg.tier,
                "capacity_blocks": self.backend.capacity_bytes // self.cfg.slot_bytes,
                "used_blocks": self.backend.used_bytes // self.cfg.slot_bytes}
