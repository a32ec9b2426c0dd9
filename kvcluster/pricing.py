"""What a deployment costs: per hour, and per million prompt tokens at its projected throughput.

A deployment is a node type (a tiers file's or a cluster file's node) running the
tiers of one hierarchy. It pays for all of the node's GPUs by the hour, and for
the KV-cache share (`usable_fraction`) of each tier below HBM that it runs; HBM
comes with the GPUs. Each price is written in the node's file next to a
`price_source` that says where it comes from, so a figure can be checked and
updated without reading code.

Per million prompt tokens = node price per hour / prompt tokens the node prefills
per hour (the replay's prefill-bound throughput of one model copy x copies per
node). Decode is left out: this compares how the KV cache changes the cost of
prompts, which is where the cache acts.
"""

from __future__ import annotations

from typing import Sequence

from .tiers import GIB, NodeTiers

HOURS_PER_MONTH = 730.0  # 8,760 h / 12, the convention of cloud price sheets


def missing_prices(node: NodeTiers, tier_names: Sequence[str]) -> list[str]:
    """Fields without a price that a deployment over `tier_names` needs (empty when it can be priced)."""
    missing = []
    if node.gpu is None or node.gpu.usd_per_gpu_hour is None:
        missing.append("gpu.usd_per_gpu_hour")
    for name in tier_names:
        kind = name.rsplit("/", 1)[-1]
        if kind != "hbm" and node.tier(kind).usd_per_gib_month is None:
            missing.append(f"tiers[{kind}].usd_per_gib_month")
    return missing


def deployment_price(node: NodeTiers, tier_names: Sequence[str]) -> dict | None:
    """USD per hour of the node's GPUs and of the tiers a deployment runs; None when a price is missing."""
    if missing_prices(node, tier_names):
        return None
    gpu = node.gpu
    parts = {"gpus": gpu.count * gpu.usd_per_gpu_hour}
    for name in tier_names:
        kind = name.rsplit("/", 1)[-1]
        if kind == "hbm":
            continue
        tier = node.tier(kind)
        parts[kind] = tier.usable_bytes / GIB * tier.usd_per_gib_month / HOURS_PER_MONTH
    return {"usd_per_hour": sum(parts.values()), "usd_per_hour_by_part": parts}


def cost_per_million_prompt_tokens(node: NodeTiers, tier_names: Sequence[str],
                                   prefill_tokens_per_s: float) -> dict | None:
    """The deployment's price and what a million prompt tokens cost at `prefill_tokens_per_s` per model copy."""
    price = deployment_price(node, tier_names)
    if price is None or not prefill_tokens_per_s > 0:
        return None
    tokens_per_hour = prefill_tokens_per_s * node.model_copies * 3600.0
    return {**price, "usd_per_million_prompt_tokens": price["usd_per_hour"] / tokens_per_hour * 1e6}
