"""Cost model: prefill FLOPs from the real module tree, loads from tier specs."""

from __future__ import annotations

import pytest

from kvcluster.cost_model import make_cost_model, prefill_cost
from kvcluster.model_spec import load_model_spec
from kvcluster.sizing import size_model
from kvcluster.tiers import load_node_tiers


def test_dense_flops_are_two_per_parameter_per_token_plus_attention() -> None:
    spec = load_model_spec("llama-3.1-8b")
    cost = prefill_cost(spec)
    assert cost.active_params == spec.num_parameters
    no_attn = 2 * spec.num_parameters * 100
    attn = 4 * 32 * (32 * 128) * (100 * 101 / 2)
    assert cost.flops(0, 100) == pytest.approx(no_attn + attn)
    assert cost.flops(1000, 100) > cost.flops(0, 100)  # a cached prefix still costs attention
    assert cost.flops(1000, 0) == 0


def test_moe_counts_only_routed_experts_a_token_visits() -> None:
    spec = load_model_spec("deepseek-v3")
    active = prefill_cost(spec).active_params
    assert 36e9 < active < 39e9  # DeepSeek-V3 reports 37B activated parameters
    assert 3.0e9 < prefill_cost(load_model_spec("qwen3-next-80b-a3b")).active_params < 4.2e9


def test_sliding_layers_attend_only_their_window() -> None:
    cost = prefill_cost(load_model_spec("mistral-7b-v0.1"))
    far = cost.flops(100_000, 10) - cost.flops(50_000, 10)
    assert far == 0  # beyond the window more prefix costs nothing


def test_ttft_adds_lower_tier_loads_and_missed_prefill() -> None:
    spec = load_model_spec("llama-3.1-8b")
    node = load_node_tiers("h100-node")
    model = make_cost_model(spec, size_model(spec), node, ("hbm", "dram"), block_size=512)
    cold = model.ttft([0, 0], 4096)
    hbm = model.ttft([8, 0], 4096)
    dram = model.ttft([0, 8], 4096)
    assert hbm == 0.0 and 0 < dram < cold
    assert dram == pytest.approx(node.tier("dram").read_seconds(8 * 512 * 131072))
