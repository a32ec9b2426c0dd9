"""The sizing engine against the tensors transformers really caches.

For every shipped architecture family a scaled-down config of the same kind is
built with random weights, run forward, and the bytes in its cache are counted.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvcluster.model_spec import spec_from_dict
from kvcluster.paths import configs_dir
from kvcluster.sizing import cache_tensor_bytes, size_model

CONTEXT = 21  # longer than the tiny sliding window (8) so windows are exercised

FAMILIES = [
    "llama-3.1-8b", "llama-3.1-70b", "mistral-7b-v0.1", "qwen2.5-7b", "qwen3-8b", "falcon-7b", "gpt2",
    "deepseek-v3", "deepseek-v2-lite", "gemma-2-9b", "gemma-3-27b", "gpt-oss-20b", "qwen3-next-80b-a3b",
]


def tiny_config(name: str) -> dict:
    """The shipped config with every size shrunk but its attention kind kept."""
    raw = json.loads((configs_dir() / "models" / f"{name}.json").read_text())
    heads, kv = raw.get("num_attention_heads", raw.get("n_head")), raw.get("num_key_value_heads")
    small_kv = 4 if kv == heads else (1 if kv == 1 else 2)
    shrink = {
        "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": small_kv,
        "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256, "torch_dtype": "float32",
        "n_embd": 64, "n_head": 4, "n_layer": 4, "n_positions": 256,
        "moe_intermediate_size": 32, "n_routed_experts": 4, "num_local_experts": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "experts_per_token": 2, "n_group": 1, "topk_group": 1,
        "kv_lora_rank": 24, "q_lora_rank": 32 if raw.get("q_lora_rank") else None,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "shared_expert_intermediate_size": 32, "rope_scaling": None,
    }
    out = {k: v for k, v in raw.items() if not k.startswith("_")}
    out.update({k: v for k, v in shrink.items() if k in raw})
    out["num_hidden_layers"] = 6 if name.startswith("gemma-3") else 4
    if raw.get("sliding_window") and raw.get("use_sliding_window", True):
        out["sliding_window"] = 8
    if "layer_types" in raw:
        out["layer_types"] = raw["layer_types"][: out["num_hidden_layers"]]
    if "first_k_dense_replace" in raw:
        out["first_k_dense_replace"] = 1
    if raw.get("model_type") == "falcon":
        out["num_attention_heads"] = 4
    if raw.get("model_type") == "gpt2":
        out.pop("num_hidden_layers")
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_bytes_equal_transformers_cache(name: str) -> None:
    from transformers import AutoModelForCausalLM, DynamicCache

    raw = tiny_config(name)
    spec = spec_from_dict(raw, name=f"tiny-{name}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(spec.hf_config).eval()
    ids = torch.randint(0, 128, (1, CONTEXT))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
    report = size_model(spec, dtype="fp32", context=CONTEXT)
    assert report.bytes_per_sequence == cache_tensor_bytes(cache), (name, [l.kind for l in spec.layers])


def test_mla_is_sized_as_latent_as_transformers_keeps_it() -> None:
    from transformers import AutoModelForCausalLM

    spec = spec_from_dict(tiny_config("deepseek-v3"), name="tiny-ds")
    model = AutoModelForCausalLM.from_config(spec.hf_config).eval()
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 128, (1, CONTEXT)), use_cache=True)
    cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
    layer = cache.layers[0]
    assert layer.keys.shape[-1] == 24  # kv_lora_rank: the latent
    assert layer.values.shape[-1] == 8  # qk_rope_head_dim: the decoupled RoPE key
    assert spec.layers[0].elems_per_token() == 24 + 8


def test_sliding_layers_keep_window_minus_one_tokens() -> None:
    spec = spec_from_dict(tiny_config("mistral-7b-v0.1"), name="tiny-mistral")
    report = size_model(spec, dtype="bf16", context=100)
    assert {layer.tokens_kept for layer in report.layers} == {7}
    assert size_model(spec, dtype="bf16", context=5).layers[0].tokens_kept == 5
