"""Between a transformers cache and block payloads, per the storage layout.

One payload per full block, in `BlockLayout` order: `[layers, 2, kv_heads,
block_tokens, head_dim]` for MHA/GQA/MQA, or the MLA latent `[layers,
block_tokens, kv_lora_rank + rope]` (transformers >= 5.15 caches the normalized
latent in the keys slot and the roped k_pe in the values slot; both go in, and
nothing decompressed does). Bytes move as the tensors' raw bits, so bf16 needs no
numpy dtype. Sliding-window layers record every token of the request
(`activate_past_recording`) so each block leaves with all its layers, and a
restored cache carries the true token count (`cumulative_length`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..storage.layout import BlockLayout
from .rope import RopeGeometry, rerotate

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class KVCodec:
    def __init__(self, layout: BlockLayout, model_config: Any) -> None:
        self.layout = layout
        self.config = model_config
        self.dtype = _TORCH_DTYPES[layout.dtype]
        self.latent_rank = int(getattr(model_config, "kv_lora_rank", 0) or 0) if layout.kind == "latent" else 0

    def new_cache(self):
        """An empty cache of the model's layer types, keeping every token of the request."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        return cache

    def encode(self, cache, first_block: int, last_block: int) -> list[np.ndarray]:
        """Payloads of blocks [first_block, last_block) of the cached sequence (uint8 arrays)."""
        n = last_block - first_block
        if n <= 0:
            return []
        B, lay = self.layout.block_tokens, self.layout
        lo, hi = first_block * B, last_block * B
        per_layer = []
        for i in lay.layers:
            layer = cache.layers[i]
            offset = _offset(layer)
            if lo < offset:
                raise ValueError(f"layer {i} no longer holds tokens {lo}..{offset}")
            k, v = layer.keys[0, :, lo - offset : hi - offset], layer.values[0, :, lo - offset : hi - offset]
            if lay.kind == "latent":  # [1, T, r] + [1, T, rope] -> [T, r + rope]
                per_layer.append(torch.cat([k[0], v[0]], dim=-1))
            else:
                per_layer.append(torch.stack([k, v]))  # [2, H, T, D]
        if lay.kind == "latent":
            whole = torch.stack(per_layer).view(len(lay.layers), n, B, lay.head_dim).transpose(0, 1)
        else:
            whole = torch.stack(per_layer).view(len(lay.layers), 2, lay.kv_heads, n, B, lay.head_dim)
            whole = whole.permute(3, 0, 1, 2, 4, 5)
        whole = whole.to(self.dtype).contiguous()  # [n, *block shape]
        raw = whole.view(torch.uint8).reshape(n, -1).numpy()
        return [raw[j].copy() for j in range(n)]

    def decode(self, payloads: Sequence[np.ndarray]):
        """A cache holding the blocks' tokens, ready for the rest of the prompt."""
        cache = self.new_cache()
        if not payloads:
            return cache
        lay, n = self.layout, len(payloads)
        raw = torch.from_numpy(np.stack([np.asarray(p, dtype=np.uint8)[: lay.nbytes()] for p in payloads]))
        typed = raw.view(self.dtype).view(n, *lay.shape())
        for pos, i in enumerate(lay.layers):
            if lay.kind == "latent":
                seq = typed[:, pos].reshape(n * lay.block_tokens, lay.head_dim)  # [T, r + rope]
                k = seq[:, : self.latent_rank][None, None]
                v = seq[:, self.latent_rank :][None, None]
            else:
                kv = typed[:, pos].permute(1, 2, 0, 3, 4).reshape(2, lay.kv_heads, n * lay.block_tokens, lay.head_dim)
                k, v = kv[0][None], kv[1][None]
            cache.layers[i].update(k.contiguous(), v.contiguous())
        return cache

    def rerotate(self, payloads: Sequence[np.ndarray], delta: int, geom: RopeGeometry) -> list[np.ndarray]:
        """The same blocks moved `delta` positions: their RoPE keys rotated, everything else as stored.

        Exact for what the cache holds: the keys equal those computed at the new
        positions from the same hidden states (MLA: only the decoupled rope part of
        the latent turns; the compressed latent has no position).
        """
        if not payloads or delta == 0:
            return [np.asarray(p).copy() for p in payloads]
        lay, n = self.layout, len(payloads)
        raw = torch.from_numpy(np.stack([np.asarray(p, dtype=np.uint8)[: lay.nbytes()] for p in payloads]))
        typed = raw.view(self.dtype).view(n, *lay.shape()).clone()
        if lay.kind == "latent":
            typed[..., self.latent_rank :] = rerotate(typed[..., self.latent_rank :], delta, geom)
        else:
            typed[:, :, 0] = rerotate(typed[:, :, 0], delta, geom)  # [n, L, H, B, D]: keys only
        flat = typed.view(torch.uint8).reshape(n, -1).numpy()
        return [flat[j].copy() for j in range(n)]

    def check(self, payload: np.ndarray) -> bool:
        """A payload of the right size for this layout (anything else is a miss)."""
        return payload is not None and payload.nbytes >= self.layout.nbytes()


def _offset(layer) -> int:
    """Token index of the first token a cache layer still holds."""
    held = layer.keys.shape[-2] if layer.keys is not None and layer.keys.numel() else 0
    total = getattr(layer, "cumulative_length", None)
    return 0 if total is None else int(total) - held
