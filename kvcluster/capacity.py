"""How many KV tokens of one model a node's tiers hold."""

from __future__ import annotations

from dataclasses import dataclass

from .sizing import SizingReport
from .tiers import NodeTiers


@dataclass(frozen=True)
class TierCapacity:
    name: str
    medium: str
    bytes: int  # given to the KV cache (HBM: after the weights)
    tokens: int
    sequences: int  # sequences of the report's context length


@dataclass(frozen=True)
class CapacityReport:
    model: str
    node: str
    dtype: str
    bytes_per_token: int
    context: int
    tiers: tuple[TierCapacity, ...]
    weights_fit_in_hbm: bool

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tiers)

    @property
    def total_tokens(self) -> int:
        return sum(t.tokens for t in self.tiers)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "node": self.node,
            "dtype": self.dtype,
            "bytes_per_token": self.bytes_per_token,
            "context": self.context,
            "weights_fit_in_hbm": self.weights_fit_in_hbm,
            "tiers": [t.__dict__ for t in self.tiers],
            "total_bytes": self.total_bytes,
            "total_tokens": self.total_tokens,
        }


def node_capacity(report: SizingReport, node: NodeTiers) -> CapacityReport:
    """Per-tier KV bytes and tokens; HBM loses the weights of every model copy first."""
    weights = report.weight_bytes * node.model_copies
    per_token = max(1, report.bytes_per_token)
    per_seq = max(1, report.bytes_per_sequence)
    tiers = []
    for tier in node.tiers:
        usable = tier.usable_bytes
        if tier.name == "hbm":
            usable = max(0, usable - weights)
        tiers.append(TierCapacity(tier.name, tier.medium, usable, usable // per_token, usable // per_seq))
    fits = node.tiers[0].name != "hbm" or node.tiers[0].usable_bytes >= weights
    return CapacityReport(
        model=report.model,
        node=node.name,
        dtype=report.dtype,
        bytes_per_token=report.bytes_per_token,
        context=report.context,
        tiers=tuple(tiers),
        weights_fit_in_hbm=fits,
    )
