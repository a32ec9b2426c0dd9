"""Exact KV-cache bytes for a model, per layer and per sequence.

Why a separate engine: frameworks that expand every layer to full multi-head K/V
over-allocate by up to ~57x (MLA) and waste memory on sliding layers that only
keep a window. Every figure here is checked in tests against the tensors that
transformers actually caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .dtypes import canonical_dtype, dtype_bytes
from .errors import ConfigError
from .model_spec import AttentionKind, LayerSpec, ModelSpec

GIB = 1 << 30


@dataclass(frozen=True)
class LayerSize:
    """One layer's cache cost at the report's context and dtype."""

    index: int
    kind: str
    kv_heads: int
    head_dim: int
    bytes_per_token: int  # per cached token (0 for linear layers)
    tokens_kept: int  # at the report's context
    fixed_bytes: int  # linear-attention state, independent of context
    bytes_at_context: int
    naive_bytes_per_token: int


@dataclass(frozen=True)
class SizingReport:
    """KV bytes for one sequence of `context` tokens, exact and naive."""

    model: str
    variant: str
    dtype: str
    context: int
    layers: tuple[LayerSize, ...]
    num_parameters: int
    weight_bytes: int

    @property
    def bytes_per_token(self) -> int:
        """Marginal bytes of one more token while every window still grows."""
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def naive_bytes_per_token(self) -> int:
        return sum(layer.naive_bytes_per_token for layer in self.layers)

    @property
    def bytes_per_sequence(self) -> int:
        """Exact bytes one sequence of `context` tokens holds (windows and states included)."""
        return sum(layer.bytes_at_context for layer in self.layers)

    @property
    def naive_bytes_per_sequence(self) -> int:
        return self.naive_bytes_per_token * self.context

    @property
    def overprovision_ratio(self) -> float:
        """Naive over exact bytes for a sequence of `context` tokens."""
        return self.naive_bytes_per_sequence / max(1, self.bytes_per_sequence)

    def max_sequences(self, hbm_bytes: int) -> tuple[int, int]:
        """(exact, naive) count of `context`-token sequences that fit in HBM after weights."""
        budget = hbm_bytes - self.weight_bytes
        if budget < 0:
            raise ConfigError(
                f"weights ({self.weight_bytes / GIB:.1f} GiB) do not fit in --hbm-gib "
                f"({hbm_bytes / GIB:.1f} GiB)"
            )
        return budget // max(1, self.bytes_per_sequence), budget // max(1, self.naive_bytes_per_sequence)

    def to_dict(self, hbm_bytes: int | None = None) -> dict:
        """The JSON shape of `kvcluster size --json`."""
        out = {
            "model": self.model,
            "variant": self.variant,
            "dtype": self.dtype,
            "context": self.context,
            "bytes_per_token": self.bytes_per_token,
            "naive_bytes_per_token": self.naive_bytes_per_token,
            "bytes_per_sequence": self.bytes_per_sequence,
            "naive_bytes_per_sequence": self.naive_bytes_per_sequence,
            "overprovision_ratio": round(self.overprovision_ratio, 4),
            "num_parameters": self.num_parameters,
            "weight_bytes": self.weight_bytes,
            "layers": [layer.__dict__ for layer in self.layers],
        }
        if hbm_bytes is not None:
            exact, naive = self.max_sequences(hbm_bytes)
            out["hbm"] = {
                "hbm_bytes": hbm_bytes,
                "kv_budget_bytes": hbm_bytes - self.weight_bytes,
                "max_sequences": exact,
                "naive_max_sequences": naive,
                "batch_gain": round(exact / naive, 4) if naive else None,
            }
        return out


def layer_size(layer: LayerSpec, context: int, elem_bytes: int, state_bytes: int) -> LayerSize:
    """Size one layer: per-token bytes, tokens kept at `context`, and fixed state."""
    per_token = layer.elems_per_token() * elem_bytes
    kept = layer.tokens_kept(context)
    fixed = layer.state_elems * state_bytes if layer.kind is AttentionKind.LINEAR else 0
    return LayerSize(
        index=layer.index,
        kind=layer.kind.value,
        kv_heads=layer.kv_heads,
        head_dim=layer.head_dim + layer.rope_dim,
        bytes_per_token=per_token,
        tokens_kept=kept,
        fixed_bytes=fixed,
        bytes_at_context=per_token * kept + fixed,
        naive_bytes_per_token=2 * layer.naive_heads * layer.naive_head_dim * elem_bytes,
    )


def size_model(
    spec: ModelSpec,
    dtype: str | None = None,
    context: int | None = None,
    weights_dtype: str | None = None,
) -> SizingReport:
    """Exact KV sizing of `spec` for one sequence of `context` tokens in `dtype`.

    `dtype` defaults to the model's own dtype; `context` to its max position
    (capped at 32,768); linear-attention state is sized in the same dtype.
    """
    dtype = canonical_dtype(dtype or spec.dtype)
    if context is None:
        context = min(spec.max_position_embeddings or 4096, 32768)
    if context <= 0:
        raise ConfigError(f"--context must be a positive token count, got {context}")
    if spec.max_position_embeddings and context > spec.max_position_embeddings:
        raise ConfigError(
            f"--context {context} exceeds {spec.name}'s max_position_embeddings ({spec.max_position_embeddings})"
        )
    elem = dtype_bytes(dtype)
    layers = tuple(layer_size(layer, context, elem, elem) for layer in spec.layers)
    params = spec.num_parameters
    return SizingReport(
        model=spec.name,
        variant=spec.variant,
        dtype=dtype,
        context=context,
        layers=layers,
        num_parameters=params,
        weight_bytes=params * dtype_bytes(weights_dtype or spec.weights_dtype or spec.dtype),
    )


def decompressed_mla_bytes_per_token(spec: ModelSpec, dtype: str) -> int:
    """Per-token bytes if MLA K/V were decompressed per head (pre-5.15 transformers layout)."""
    cfg = spec.hf_config.get_text_config()
    per_layer = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return per_layer * len(spec.layers) * dtype_bytes(dtype)


def cache_tensor_bytes(cache: Any) -> int:
    """Bytes of every tensor a transformers cache holds (K/V, the MLA latent, conv and recurrent state).

    The measured side of `size_model`: the sizing tests and the GPU check both hold the
    engine's figure against this count, so they count the same way.
    """
    import torch  # only a caller that holds a transformers cache gets here: the core imports no torch for sizing

    total = 0
    for layer in cache.layers:
        for attr in ("keys", "values", "conv_states", "recurrent_states"):
            value = getattr(layer, attr, None)
            parts = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
            total += sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))
    return total
