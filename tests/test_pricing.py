"""Cost per million prompt tokens: exact arithmetic, and prices refused without a source."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvcluster.pricing import cost_per_million_prompt_tokens, deployment_price, missing_prices
from kvcluster.tiers import NodeTiers


def node(**dram) -> NodeTiers:
    return NodeTiers.model_validate({
        "name": "priced",
        "model_copies": 2,
        "gpu": {"name": "g", "count": 2, "dense_bf16_tflops": 100, "usd_per_gpu_hour": 3.0, "price_source": "quote"},
        "tiers": [{"kind": "hbm", "capacity": "10GiB"},
                  {"kind": "dram", "capacity": "100GiB", "usable_fraction": 0.5, **dram},
                  {"kind": "nvme", "capacity": "1000GiB"}],
    })


def test_a_deployment_pays_for_its_gpus_and_the_usable_share_of_each_tier_below_hbm() -> None:
    priced = node(usd_per_gib_month=0.73, price_source="quote")
    # 2 GPUs x $3 + 50 usable GiB x $0.73 / 730 h
    assert deployment_price(priced, ["hbm", "dram"]) == {
        "usd_per_hour": pytest.approx(6.05), "usd_per_hour_by_part": {"gpus": 6.0, "dram": pytest.approx(0.05)}}
    assert deployment_price(priced, ["hbm"])["usd_per_hour"] == 6.0
    # 1,000 prompt tokens/s per copy x 2 copies = 7.2M tokens an hour
    cost = cost_per_million_prompt_tokens(priced, ["hbm", "dram"], 1000.0)
    assert cost["usd_per_million_prompt_tokens"] == pytest.approx(6.05 / 7.2)


def test_a_tier_without_a_price_is_named_and_nothing_is_priced() -> None:
    priced = node(usd_per_gib_month=0.73, price_source="quote")
    assert missing_prices(priced, ["hbm", "dram", "nvme"]) == ["tiers[nvme].usd_per_gib_month"]
    assert deployment_price(priced, ["hbm", "dram", "nvme"]) is None
    assert cost_per_million_prompt_tokens(priced, ["hbm", "dram", "nvme"], 1000.0) is None
    assert missing_prices(priced, ["node-a/hbm", "node-a/dram"]) == []  # a control plane's tier labels


def test_a_price_needs_its_source() -> None:
    with pytest.raises(ValidationError, match="usd_per_gib_month needs a price_source"):
        node(usd_per_gib_month=0.73)
    with pytest.raises(ValidationError, match="usd_per_gpu_hour needs a price_source"):
        NodeTiers.model_validate({"name": "n", "gpu": {"name": "g", "count": 1, "dense_bf16_tflops": 1,
                                                      "usd_per_gpu_hour": 1.0},
                                  "tiers": [{"kind": "hbm", "capacity": "1GiB"}]})
