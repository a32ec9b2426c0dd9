"""A model's attention layout, read from a transformers config.

Every layer gets one `LayerSpec` saying what it caches per token. The config is
parsed by transformers itself (`AutoConfig.for_model`), so derived fields such as
`layer_types` are exactly what the model code will use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .config_files import resolve_config


class AttentionKind(str, Enum):
    """What one layer keeps per token."""

    FULL = "full"  # K and V for every token, per KV head
    SLIDING = "sliding"  # K and V for the last window-1 tokens
    MLA = "mla"  # one compressed latent plus a decoupled RoPE key per token
    LINEAR = "linear"  # a fixed-size recurrent and conv state, no per-token KV


@dataclass(frozen=True)
class LayerSpec:
    """The cache shape of one decoder layer."""

    index: int
    kind: AttentionKind
    kv_heads: int  # KV heads (1 for an MLA latent, 0 for linear layers)
    head_dim: int  # width of K and of V per head; for MLA the latent width
    rope_dim: int = 0  # MLA: width of the decoupled RoPE key
    window: int | None = None  # sliding layers: the attention window
    state_elems: int = 0  # linear layers: elements of conv + recurrent state
    naive_heads: int = 0  # heads a framework that expands every layer to MHA allocates
    naive_head_dim: int = 0

    def elems_per_token(self) -> int:
        """Cached elements per token of this layer (0 for linear layers)."""
        if self.kind is AttentionKind.MLA:
            return self.head_dim + self.rope_dim
        if self.kind is AttentionKind.LINEAR:
            return 0
        return 2 * self.kv_heads * self.head_dim

    def tokens_kept(self, context: int) -> int:
        """Tokens this layer holds after `context` tokens (transformers keeps window-1)."""
        if self.kind is AttentionKind.SLIDING and self.window is not None:
            return min(context, self.window - 1)
        return 0 if self.kind is AttentionKind.LINEAR else context


@dataclass(frozen=True)
class ModelSpec:
    """A model's identity and per-layer cache layout."""

    name: str
    model_type: str
    hf_config: Any = field(repr=False, compare=False)
    layers: tuple[LayerSpec, ...]
    num_attention_heads: int
    hidden_size: int
    max_position_embeddings: int
    dtype: str
    weights_dtype: str = ""  # how the published weights are stored (DeepSeek-V3 ships fp8)

    @property
    def variant(self) -> str:
        """mha, mqa, gqa, mla, or hybrid (mixed kinds), for display."""
        kinds = {layer.kind for layer in self.layers}
        if AttentionKind.MLA in kinds:
            return "mla"
        heads = {layer.kv_heads for layer in self.layers if layer.kind is not AttentionKind.LINEAR}
        base = "mha" if heads == {self.num_attention_heads} else "mqa" if heads == {1} else "gqa"
        if AttentionKind.LINEAR in kinds:
            return f"hybrid-linear/{base}"
        if kinds == {AttentionKind.SLIDING}:
            return f"{base}-sliding"
        if AttentionKind.SLIDING in kinds:
            return f"hybrid-sliding/{base}"
        return base

    @cached_property
    def num_parameters(self) -> int:
        """Exact parameter count, by building the model on the meta device (no memory)."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.hf_config)
        return sum(p.numel() for p in model.parameters())


def resolve_model_path(name_or_path: str) -> Path:
    """A shipped model name (configs/models/NAME.json), a config.json path, or a checkpoint dir."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    return resolve_config(name_or_path, "models", ".json", "model")


def load_model_spec(name_or_path: str) -> ModelSpec:
    """Load a model by shipped name or config path and derive its layer layout."""
    path = resolve_model_path(name_or_path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"malformed model config {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"malformed model config {path}: expected a JSON object")
    return spec_from_dict(raw, name=path.stem if path.name != "config.json" else path.parent.name)


def spec_from_dict(raw: dict[str, Any], name: str) -> ModelSpec:
    """Build a ModelSpec from a config.json-style dict (keys starting with _ are notes)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if not k.startswith("_")}
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ConfigError(f"model config {name!r} has no 'model_type'")
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model config {name!r} rejected by transformers: {exc}") from None
    spec = spec_from_config(config, name)
    weights_dtype = raw.get("_weights_dtype")
    return replace(spec, weights_dtype=str(weights_dtype)) if weights_dtype else spec


def spec_from_config(config: Any, name: str) -> ModelSpec:
    """Derive the per-layer layout from a transformers PretrainedConfig."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        layers = tuple(_layer_spec(text, i) for i in range(int(text.num_hidden_layers)))
        heads = int(text.num_attention_heads)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(f"model config {name!r} lacks an attention field: {exc}") from None
    dtype = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "float32"
    return ModelSpec(
        name=name,
        model_type=text.model_type,
        hf_config=config,
        layers=layers,
        num_attention_heads=heads,
        hidden_size=int(text.hidden_size),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 0),
        dtype=str(dtype).removeprefix("torch."),
        weights_dtype=str(dtype).removeprefix("torch."),
    )


def _kv_heads(cfg: Any) -> int:
    """KV heads as the model code computes them (Falcon's multi_query means 1)."""
    if cfg.model_type == "falcon":
        if cfg.new_decoder_architecture or not cfg.multi_query:
            return int(cfg.num_kv_heads)
        return 1
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def _head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _layer_kind(cfg: Any, index: int) -> str:
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return str(layer_types[index])
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding_attention"
    return "full_attention"


def _layer_spec(cfg: Any, index: int) -> LayerSpec:
    kv_heads, head_dim = _kv_heads(cfg), _head_dim(cfg)
    if getattr(cfg, "kv_lora_rank", None):
        return LayerSpec(
            index=index,
            kind=AttentionKind.MLA,
            kv_heads=1,
            head_dim=int(cfg.kv_lora_rank),
            rope_dim=int(cfg.qk_rope_head_dim),
            naive_heads=kv_heads,
            naive_head_dim=int(cfg.v_head_dim),
        )
    kind = _layer_kind(cfg, index)
    naive = {"naive_heads": kv_heads, "naive_head_dim": head_dim}
    if kind == "linear_attention":
        return LayerSpec(index, AttentionKind.LINEAR, 0, 0, state_elems=_linear_state_elems(cfg), **naive)
    if kind in ("sliding_attention", "chunked_attention"):
        window = int(getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size"))
        return LayerSpec(index, AttentionKind.SLIDING, kv_heads, head_dim, window=window, **naive)
    if kind != "full_attention":
        raise ConfigError(f"layer {index} has unsupported attention type {kind!r}")
    return LayerSpec(index, AttentionKind.FULL, kv_heads, head_dim, **naive)


def _linear_state_elems(cfg: Any) -> int:
    """Gated DeltaNet (Qwen3-Next) state: depthwise conv window plus per-head recurrent matrix."""
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * cfg.linear_conv_kernel_dim
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return int(conv + recurrent)
