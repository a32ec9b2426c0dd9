"""Cluster layout for the cache actors: which Ray node runs which tiers, sized in bytes.

`kvcluster cluster up` reads this. Tier capacities are given in GiB and turned
into block slots with the sizing engine's block payload for the model, so a
tier holds exactly as many blocks as its bytes allow.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .config_files import load_yaml_model, resolve_config
from .errors import ConfigError
from .model_spec import load_model_spec
from .predictor import PredictorConfig
from .storage.layout import layout_for


DEFAULT_POLICY = "bayes"  # what `kvcluster replay` runs by default too


class TierEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tier: Literal["dram", "cxl", "nvme", "pfs"]
    capacity_gib: float = Field(gt=0)
    path: str | None = Field(None, description="Directory (nvme: local to the node; pfs: shared by all nodes).")


class NodeEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Name in actor names and the index.")
    ray_resource: str | None = Field(None, description="Custom resource that marks the Ray node; none: the head.")
    tiers: list[TierEntry] = Field(min_length=1)


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="A name under configs/models or a config path: sizes the blocks.")
    block_tokens: int = Field(16, gt=0)
    dtype: str | None = None
    checkpoint_dir: str = Field(description="Where the predictor checkpoints (on the shared filesystem).")
    nodes: list[NodeEntry] = Field(min_length=1)
    predictor: PredictorConfig = Field(PredictorConfig(), description="Priors and horizon of the cluster's "
                                       "reuse predictor (used when it first starts; a checkpoint's posteriors win).")
    index_shards: int = Field(1, ge=1, le=64, description="Actors the global block index is split over by key "
                              "hash; a lookup is one batched call per shard, issued together.")
    control_shards: int = Field(1, ge=1, le=64, description="Control plane actors the cache managers' state is "
                                "split over by key hash; each owns its blocks and a share of every tier.")
    policy: str = Field(DEFAULT_POLICY, description="Eviction policy of every node's hierarchy, run by the control "
                        "plane actor (the one `kvcluster replay --policy` measures); an online policy.")

    @field_validator("policy")
    @classmethod
    def _online_policy(cls, name: str) -> str:
        from .policies.registry import POLICIES, policy_names

        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(policy_names())}")
        if POLICIES[name].offline:
            raise ValueError(f"{name!r} reads the future: a live cluster cannot run it")
        return name

    def block_bytes(self) -> int:
        return layout_for(load_model_spec(self.model), self.block_tokens, self.dtype).nbytes()

    def slots(self, tier: TierEntry) -> int:
        n = int(tier.capacity_gib * (1 << 30)) // self.block_bytes()
        if n < 1:
            raise ConfigError(f"tier {tier.tier} ({tier.capacity_gib} GiB) holds no {self.block_bytes()}-byte block")
        return n


def load_cluster_config(name_or_path: str) -> ClusterConfig:
    """Read and validate a cluster YAML; errors name the file and the field."""
    path = resolve_config(name_or_path, "cluster", ".yaml", "cluster file")
    cfg = load_yaml_model(path, ClusterConfig, "cluster")
    for node in cfg.nodes:
        for t in node.tiers:
            if t.tier in ("nvme", "pfs") and not t.path:
                raise ConfigError(f"{path}: field nodes.{node.name}.{t.tier}.path: the {t.tier} tier needs a path")
    return cfg
