"""kvcluster: exact KV sizing, tiered KV storage and reuse-aware eviction for LLM serving."""

from .errors import ConfigError, KvclusterError, TraceError
from .model_spec import AttentionKind, LayerSpec, ModelSpec, load_model_spec
from .sizing import SizingReport, size_model
from .tiers import NodeTiers, TierSpec, load_node_tiers

__all__ = [
    "AttentionKind",
    "ConfigError",
    "KvclusterError",
    "LayerSpec",
    "ModelSpec",
    "NodeTiers",
    "SizingReport",
    "TierSpec",
    "TraceError",
    "load_model_spec",
    "load_node_tiers",
    "size_model",
]
