"""Cluster layout: which Ray node runs which tiers, sized in bytes, and everything that follows from it.

`kvcluster cluster up` reads this. A node is the tier spec's node (`tiers.NodeTiers`:
tiers with capacity, bandwidth, latency and path, optionally its GPUs) plus where it
runs, so the same file feeds the live actors, the control plane's hierarchy, the
simulator (`kvcluster replay --topology`) and the cost model. Tier capacities are
sizes with their unit (`capacity: 4GiB`, as everywhere a tier is written), turned into
block slots with the sizing engine's block payload for the model, so a tier holds
exactly as many blocks as its bytes allow. `block_tokens`
is set here only: the Serve app's replicas take it from this file.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .config_files import load_yaml_model, resolve_config
from .errors import ConfigError
from .model_spec import load_model_spec
from .predictor import PredictorConfig
from .storage.layout import layout_for
from .tiers import NODE_TIERS, NodeTiers, TierSpec, check_tiers, format_size


DEFAULT_POLICY = "bayes"  # what `kvcluster replay` runs by default too


class NodeEntry(NodeTiers):
    """A node of the cluster: the tier spec's node, whose tiers run as tier actors, and the Ray node it runs on."""

    ray_resource: str | None = Field(None, description="Custom resource that marks the Ray node; none: the head.")

    @field_validator("tiers")
    @classmethod
    def _actor_tiers(cls, tiers: list[TierSpec]) -> list[TierSpec]:
        check_tiers(tiers, NODE_TIERS, "a node's tier actor (hbm lives in the model replicas, rdma is other "
                                       "nodes' pools)")
        return tiers


class ClusterConfig(BaseModel):
    """The whole cluster file: the model whose blocks it stores, its nodes, and the control plane's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="A name under configs/models or a config path: sizes the blocks.")
    block_tokens: int = Field(16, gt=0, description="Tokens per KV block, for the whole cluster: the tier actors' "
                              "slots, the replicas' block keys and the ingress's routing all use this one value.")
    dtype: str | None = Field(None, description="KV dtype of the block payload (default: the model's).")
    checkpoint_dir: str = Field(description="Where the predictor checkpoints (on the shared filesystem).")
    nodes: list[NodeEntry] = Field(min_length=1, description="The Ray nodes that run tier actors; the first is "
                                   "the one `kvcluster replay --topology` simulates.")
    predictor: PredictorConfig = Field(PredictorConfig(), description="Priors and horizon of the cluster's "
                                       "reuse predictor (used when it first starts; a checkpoint's posteriors win).")
    index_shards: int = Field(1, ge=1, le=64, description="Actors the global block index is split over by key "
                              "hash; a lookup is one batched call per shard, issued together.")
    policy: str = Field(DEFAULT_POLICY, description="Eviction policy of every node's hierarchy, run by each "
                        "node's controller (the one `kvcluster replay --policy` measures); an online policy.")

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

    def node(self, name: str | None = None) -> NodeEntry:
        """The node called `name` (None: the first)."""
        if name is None:
            return self.nodes[0]
        for node in self.nodes:
            if node.name == name:
                return node
        raise ConfigError(f"nodes: no node {name!r}; the cluster has {', '.join(n.name for n in self.nodes)}")

    def slots(self, tier: TierSpec) -> int:
        n = tier.usable_bytes // self.block_bytes()
        if n < 1:
            raise ConfigError(f"tier {tier.kind} (capacity {format_size(tier.capacity)}) holds no "
                              f"{self.block_bytes()}-byte block")
        return n


def load_cluster_config(name_or_path: str) -> ClusterConfig:
    """Read and validate a cluster YAML; errors name the file and the field."""
    return load_yaml_model(resolve_config(name_or_path, "cluster", ".yaml", "cluster file"), ClusterConfig, "cluster")
