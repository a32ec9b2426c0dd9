"""Projected TTFT and throughput of a replay, from tier specs and prefill FLOPs.

The tier specs are the one schema of `tiers.py`: a tiers file's node or a cluster
file's node give the same figures (read bandwidth, latency, GPUs).

TTFT of a request = time to load its hit blocks from the tiers that hold them
(per-tier latency once per request, then bytes / read bandwidth) + time to
prefill the missed tokens on the node's GPUs (dense + attention FLOPs at the
configured MFU). Loads and compute are added, not overlapped: a conservative
projection. HBM hits cost nothing to load.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .model_spec import AttentionKind, ModelSpec
from .sizing import SizingReport
from .tiers import NodeTiers


@dataclass(frozen=True)
class PrefillCost:
    """FLOPs of prefilling `new` tokens after a cached prefix of `cached` tokens."""

    active_params: int  # parameters touched per token (MoE: shared + routed top-k)
    attn_layers: tuple[tuple[int, int | None], ...]  # (q-heads x qk/v dim product, window) per attention layer

    def flops(self, cached: int, new: int) -> float:
        if new <= 0:
            return 0.0
        dense = 2.0 * self.active_params * new
        attn = 0.0
        for width, window in self.attn_layers:
            # QK^T and AV: 2 matmuls x 2 FLOPs per MAC over the visible context of each new token
            if window is None:
                visible = cached * new + new * (new + 1) / 2
            else:
                visible = new * min(window, cached + new)
            attn += 4.0 * width * visible
        return dense + attn


def prefill_cost(spec: ModelSpec) -> PrefillCost:
    """Active parameters and attention widths of `spec`, from its real module tree."""
    cfg = spec.hf_config.get_text_config()
    heads = spec.num_attention_heads
    if any(layer.kind is AttentionKind.MLA for layer in spec.layers):
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        width = heads * (qk + cfg.v_head_dim) // 2
    else:
        width = heads * int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    layers = tuple(
        (width, layer.window if layer.kind is AttentionKind.SLIDING else None)
        for layer in spec.layers
        if layer.kind is not AttentionKind.LINEAR
    )
    return PrefillCost(active_params=_active_params(spec), attn_layers=layers)


def _active_params(spec: ModelSpec) -> int:
    """Total parameters minus the routed experts a token does not visit."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = spec.hf_config.get_text_config()
    experts = next(
        (int(getattr(cfg, k)) for k in ("n_routed_experts", "num_local_experts", "num_experts") if getattr(cfg, k, None)),
        0,
    )
    top_k = int(getattr(cfg, "num_experts_per_tok", 0) or getattr(cfg, "experts_per_token", 0) or 0)
    if not experts or not top_k:
        return spec.num_parameters
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.hf_config)
    routed = sum(
        p.numel() for name, p in model.named_parameters() if ".experts." in name or name.endswith(".experts.gate_up_proj")
        or name.endswith(".experts.down_proj")
    )
    return int(spec.num_parameters - routed * (1 - top_k / experts))


@dataclass(frozen=True)
class CostModel:
    """Turns per-request hit counts into TTFT for one model on one node type."""

    node: NodeTiers  # a tiers file's node, or a cluster file's (the same tier spec)
    tier_names: tuple[str, ...]  # the hierarchy's tiers, in order: kinds, or a control plane's "node/kind" labels
    block_size: int
    block_bytes: int
    prefill: PrefillCost

    @cached_property
    def compute_flops_per_s(self) -> float:
        gpu = self.node.require_gpu()
        per_copy = gpu.count / self.node.model_copies
        return gpu.dense_bf16_tflops * 1e12 * gpu.mfu * per_copy

    def ttft(self, hits_per_tier: list[int], input_tokens: int, recomputed_blocks: int = 0) -> float:
        """Seconds to first token for a request with these prefix hits per tier.

        `recomputed_blocks` are blocks inside the prefix run that lost head shards:
        each costs one block of prefill (all heads come out of the same forward).
        """
        load = 0.0
        for name, hits in zip(self.tier_names, hits_per_tier):
            kind = name.rsplit("/", 1)[-1]
            if hits and kind != "hbm":
                load += self.node.tier(kind).read_seconds(hits * self.block_bytes)
        cached = min(input_tokens, (sum(hits_per_tier) + recomputed_blocks) * self.block_size)
        redo = min(cached, recomputed_blocks * self.block_size)
        compute = (self.prefill.flops(cached, input_tokens - cached) + self.prefill.flops(cached - redo, redo))
        return load + compute / self.compute_flops_per_s


def make_cost_model(
    spec: ModelSpec, sizing: SizingReport, node: NodeTiers, tier_names: tuple[str, ...], block_size: int
) -> CostModel:
    node.require_gpu()  # before any replay starts
    return CostModel(
        node=node,
        tier_names=tier_names,
        block_size=block_size,
        block_bytes=sizing.bytes_per_token * block_size,
        prefill=prefill_cost(spec),
    )
