"""The six memory tiers of a node, as a user writes them in configs/tiers/*.yaml.

Figures come from published hardware specs (each YAML cites its sources); the
simulator's cost model and the capacity report read them from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .config_files import load_yaml_model, resolve_config
from .errors import ConfigError

TierName = Literal["hbm", "dram", "cxl", "nvme", "rdma", "pfs"]
TIER_ORDER: tuple[str, ...] = ("hbm", "dram", "cxl", "nvme", "rdma", "pfs")
GB = 1e9
GIB = 1 << 30


class TierSpec(BaseModel):
    """One tier: how much it holds and how fast a replica reaches it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: TierName = Field(description="Tier id, fastest first: hbm, dram, cxl, nvme, rdma, pfs.")
    medium: str = Field(description="The hardware, e.g. 'DDR5-4800, 2 TB per node'.")
    capacity_gib: float = Field(gt=0, description="Raw capacity of the tier on one node, GiB.")
    usable_fraction: float = Field(
        1.0, gt=0, le=1, description="Share of the capacity given to the KV cache."
    )
    read_gbps: float = Field(gt=0, description="Bandwidth into HBM for one replica, GB/s (1e9 B/s).")
    write_gbps: float = Field(gt=0, description="Bandwidth from HBM into the tier, GB/s.")
    latency_us: float = Field(ge=0, description="Per-transfer latency, microseconds.")

    @property
    def usable_bytes(self) -> int:
        return int(self.capacity_gib * GIB * self.usable_fraction)

    def read_seconds(self, nbytes: int) -> float:
        """Time to bring `nbytes` from this tier into HBM."""
        return self.latency_us * 1e-6 + nbytes / (self.read_gbps * GB)

    def write_seconds(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.write_gbps * GB)


class GpuSpec(BaseModel):
    """The accelerator that computes prefill when a block misses."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="e.g. 'H100 SXM5'.")
    count: int = Field(ge=1, description="GPUs per node.")
    dense_bf16_tflops: float = Field(gt=0, description="Dense BF16 peak per GPU, TFLOPS.")
    mfu: float = Field(0.5, gt=0, le=1, description="Achieved fraction of peak during prefill.")


class NodeTiers(BaseModel):
    """A node's tiers, fastest first, and its GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str = Field(description="Name of the node type.")
    gpu: GpuSpec
    tiers: list[TierSpec] = Field(min_length=1, description="Tiers, fastest first.")
    model_copies: int = Field(1, ge=1, description="Model replicas per node; each holds the weights in HBM.")

    @model_validator(mode="after")
    def _ordered_and_unique(self) -> "NodeTiers":
        names = [tier.name for tier in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names repeat: {names}")
        if names != sorted(names, key=TIER_ORDER.index):
            raise ValueError(f"tiers must be listed fastest first ({', '.join(TIER_ORDER)}), got {names}")
        return self

    def tier(self, name: str) -> TierSpec:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise ConfigError(f"node {self.node!r} has no tier {name!r}")


def resolve_tiers_path(name_or_path: str) -> Path:
    return resolve_config(name_or_path, "tiers", ".yaml", "tiers file")


def load_node_tiers(name_or_path: str) -> NodeTiers:
    """Read and validate a tiers YAML; errors name the file and the field."""
    return load_yaml_model(resolve_tiers_path(name_or_path), NodeTiers, "tiers")
