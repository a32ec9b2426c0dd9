"""Byte layout of one block's KV payload, per attention kind.

- MHA/GQA/MQA: `[layers, 2, kv_heads, block_tokens, head_dim]`; head shard h is the
  strided view `[:, :, h]`, addressable without touching the other heads.
- MLA: the latent `[layers, block_tokens, kv_lora_rank + qk_rope_head_dim]`, one
  shard; never decompressed per-head K/V.
- Sliding layers: a block that has left every window of its sequence needs only
  the full-attention layers (`layers_needed`), so it is stored smaller.
Payloads move as raw bits (bf16 as uint16, fp8 as uint8): numpy has no bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes import canonical_dtype, dtype_bytes
from ..errors import ConfigError
from ..model_spec import AttentionKind, ModelSpec

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


@dataclass(frozen=True)
class BlockLayout:
    kind: str  # "kv" or "latent"
    layers: tuple[int, ...]  # indices of the layers a full payload holds
    sliding: frozenset[int]  # which of them are sliding-window layers
    window: int | None  # their window (tokens)
    kv_heads: int
    head_dim: int  # K/V head dim, or the latent width (kv_lora_rank + rope)
    block_tokens: int
    dtype: str

    @property
    def elem_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def bits_dtype(self) -> type:
        return _BITS[self.elem_bytes]

    def shape(self, layers: int | None = None) -> tuple[int, ...]:
        n = len(self.layers) if layers is None else layers
        if self.kind == "latent":
            return (n, self.block_tokens, self.head_dim)
        return (n, 2, self.kv_heads, self.block_tokens, self.head_dim)

    def nbytes(self, layers: int | None = None) -> int:
        return int(np.prod(self.shape(layers))) * self.elem_bytes

    @property
    def shards(self) -> int:
        return 1 if self.kind == "latent" else self.kv_heads

    def view(self, payload: np.ndarray, layers: int | None = None) -> np.ndarray:
        """The payload's raw bytes as a typed array of `shape` (no copy)."""
        return np.frombuffer(payload, dtype=self.bits_dtype).reshape(self.shape(layers))

    def shard(self, payload: np.ndarray, head: int) -> np.ndarray:
        """Head shard `head` of a payload, as a strided view."""
        if not 0 <= head < self.shards:
            raise IndexError(f"head {head} out of range 0..{self.shards - 1}")
        typed = self.view(payload)
        return typed if self.kind == "latent" else typed[:, :, head]

    def layers_needed(self, block_index: int, seq_tokens: int) -> tuple[int, ...]:
        """Layers whose KV a block still matters for, given the sequence length so far."""
        if not self.sliding or self.window is None:
            return self.layers
        block_end = (block_index + 1) * self.block_tokens
        if block_end > seq_tokens - (self.window - 1):
            return self.layers
        return tuple(i for i in self.layers if i not in self.sliding)


def layout_for(spec: ModelSpec, block_tokens: int, dtype: str | None = None) -> BlockLayout:
    """The payload layout of `spec` for blocks of `block_tokens` (linear layers carry no per-block KV)."""
    attn = [layer for layer in spec.layers if layer.kind is not AttentionKind.LINEAR]
    if not attn:
        raise ConfigError(f"{spec.name} has no attention layers to cache per block")
    if block_tokens <= 0:
        raise ConfigError("block_tokens must be positive")
    widths = {(layer.kv_heads, layer.head_dim + layer.rope_dim) for layer in attn}
    if len(widths) != 1:
        raise ConfigError(f"{spec.name} mixes KV widths across layers: {sorted(widths)}")
    kv_heads, width = widths.pop()
    sliding = frozenset(l.index for l in attn if l.kind is AttentionKind.SLIDING)
    windows = {l.window for l in attn if l.kind is AttentionKind.SLIDING}
    return BlockLayout(
        kind="latent" if attn[0].kind is AttentionKind.MLA else "kv",
        layers=tuple(l.index for l in attn),
        sliding=sliding,
        window=min(windows) if windows else None,
        kv_heads=kv_heads,
        head_dim=width,
        block_tokens=block_tokens,
        dtype=canonical_dtype(dtype or spec.dtype),
    )
