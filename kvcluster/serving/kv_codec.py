"""Between a transformers cache and block payloads, per the storage layout.

One payload per full block, in `BlockLayout` order: `[layers, 2, kv_heads,
block_tokens, head_dim]` for MHA/GQA/MQA, or the MLA latent `[layers,
block_tokens, kv_lora_rank + rope]` (transformers >= 5.15 caches the normalized
latent in the keys slot and the roped k_pe in the values slot; both go in, and
nothing decompressed does). Bytes move as the tensors' raw bits, so bf16 needs no
numpy dtype. Sliding-window layers record every token of the request
(`activate_past_recording`) so each block leaves with all its layers (any block
may end a later prompt's prefix, where its sliding KV is needed). A restore is
window-aware: a sliding layer gets only the blocks its window still sees, and
carries the true token count (`cumulative_length`).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import torch

from ..storage.layout import BlockLayout
from .rope import RopeGeometry, rerotate

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class KVCodec:
    def __init__(self, layout: BlockLayout, model_config: Any, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)  # where decoded caches live: the model's device
        self.config = model_config
        self.dtype = _TORCH_DTYPES[layout.dtype]
        self.latent_rank = int(getattr(model_config, "kv_lora_rank", 0) or 0) if layout.kind == "latent" else 0
        self.block_bytes = layout.nbytes()
        self.block_shape = layout.shape()
        self._staging = torch.empty(0, dtype=self.dtype)  # reused restore buffer: no page faults per request
        self._landing_rows = torch.empty((0, self.block_bytes), dtype=torch.uint8)  # where fetched payloads land
        self._landing = self._landing_rows.numpy()
        self._upload = torch.empty(0, dtype=torch.uint8, pin_memory=self._on_cuda)  # payloads on their way up
        self._device_landing = torch.empty((0, self.block_bytes), dtype=torch.uint8, device=self.device)
        self._layer_kinds: list | None = None
        self._replicate = None

    def new_cache(self):
        """An empty cache of the model's layer types, keeping every token of the request.

        The layer types are read from the config once; building from them skips
        transformers' per-call config parsing (a tenth of a millisecond per request).
        """
        from transformers import DynamicCache

        if self._layer_kinds is None:
            template = DynamicCache(config=self.config)
            self._layer_kinds = [(type(l), getattr(l, "sliding_window", None)) for l in template.layers]
            self._replicate = template.layer_class_to_replicate
        cache = DynamicCache()
        cache.layers = [cls(sliding_window=w) if w else cls() for cls, w in self._layer_kinds]
        cache.layer_class_to_replicate = self._replicate
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        return cache

    def encode(self, cache, first_block: int, last_block: int, start_token: int = 0) -> list[np.ndarray]:
        """Payloads of blocks [first_block, last_block) of the cached sequence (uint8 arrays), blocks counted
        from token `start_token` (0: the sequence's own blocks; a segment's start for its blocks)."""
        n = last_block - first_block
        if n <= 0:
            return []
        B, lay = self.layout.block_tokens, self.layout
        lo, hi = start_token + first_block * B, start_token + last_block * B
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
        raw = whole.view(torch.uint8).reshape(n, -1).cpu().numpy()  # payloads are host bytes, whatever the device
        return [raw[j].copy() for j in range(n)]

    def decode(self, payloads: Sequence[np.ndarray], reuse_buffer: bool = False):
        """A cache holding the blocks' tokens, ready for the rest of the prompt.

        One strided copy per block straight into per-layer `[1, H, T, D]` tensors
        (the hot-hit path: no stacking, no per-layer concatenation). With
        `reuse_buffer` the states live in one staging buffer kept across calls
        (no page faults per request); that is safe only when a forward step runs on
        the cache before the next decode, since every step concatenates into new
        tensors. The runner always prefills at least one token right away.
        """
        cache = self.new_cache()
        for layer, k, v, *total in self._layer_states(payloads, reuse_buffer, window_aware=True):
            self._set(cache.layers[layer], k, v, *total)
        return cache

    def append(self, cache, payloads: Sequence[np.ndarray]) -> None:
        """Extend a cache with the blocks' tokens (a reused segment after what the cache holds)."""
        for layer, k, v in self._layer_states(payloads, reuse=False):
            cache.layers[layer].update(k.contiguous(), v.contiguous())

    def _window_starts(self, n: int) -> list[int]:
        """Per layer (layout order): the first of `n` restored blocks it needs.

        A sliding layer attends to its last `window - 1` cached tokens only (transformers'
        `DynamicSlidingWindowLayer.get_mask_sizes`), so older blocks are not copied for it;
        the layer still learns the true token count. Global layers need every block.
        """
        B = self.layout.block_tokens
        kinds = self._layer_kinds or []
        starts = []
        for i in self.layout.layers:
            window = kinds[i][1] if i < len(kinds) else None
            starts.append(max(0, (n * B - (window - 1)) // B) if window else 0)
        return starts

    def _layer_states(self, payloads: Sequence[np.ndarray], reuse: bool, window_aware: bool = False):
        """(layer index, keys, values) of the blocks, per layer as the cache holds them.

        `window_aware`: sliding layers get only the blocks their window still sees
        (a restore into a fresh cache; an append must add every token it counts).
        """
        if not payloads:
            return
        lay, n, B = self.layout, len(payloads), self.layout.block_tokens
        starts = self._window_starts(n) if window_aware and lay.kind != "latent" else None
        if self._on_cuda:
            yield from self._device_states(payloads, starts)
            return
        if starts is not None and any(starts):
            yield from self._windowed_states(payloads, reuse, starts)
            return
        rows = self._landed_rows(payloads)  # side by side in the landing buffer: one copy lays out them all
        if rows is not None:
            rows = rows.view(self.dtype).view(n, *self.block_shape)
        if lay.kind == "latent":
            whole = self._buffer((len(lay.layers), n, B, lay.head_dim), reuse)  # [L, n, B, W]
            if rows is not None:
                whole.copy_(rows.transpose(0, 1))
            else:
                for j, p in enumerate(payloads):
                    whole[:, j] = self._typed(p)
            whole = whole.to(self.device).view(len(lay.layers), 1, 1, n * B, lay.head_dim)
            for pos, i in enumerate(lay.layers):
                yield i, whole[pos, ..., : self.latent_rank], whole[pos, ..., self.latent_rank :]
        else:
            whole = self._buffer((len(lay.layers), 2, lay.kv_heads, n, B, lay.head_dim), reuse)
            if rows is not None:
                whole.copy_(rows.permute(1, 2, 3, 0, 4, 5))  # [n, L, 2, H, B, D] -> [L, 2, H, n, B, D]
            else:
                for j, p in enumerate(payloads):
                    whole[:, :, :, j] = self._typed(p)
            whole = whole.to(self.device).view(len(lay.layers), 2, 1, lay.kv_heads, n * B, lay.head_dim)
            for pos, i in enumerate(lay.layers):
                yield i, whole[pos, 0], whole[pos, 1]

    def _windowed_states(self, payloads: Sequence[np.ndarray], reuse: bool, starts: list[int]):
        """Like `_layer_states`, copying each block only into the layers that still need it."""
        lay, n, B = self.layout, len(payloads), self.layout.block_tokens
        whole = self._buffer((len(lay.layers), 2, lay.kv_heads, n, B, lay.head_dim), reuse)
        for j, p in enumerate(payloads):
            wanted = [pos for pos, first in enumerate(starts) if first <= j]
            if len(wanted) == len(starts):
                whole[:, :, :, j] = self._typed(p)
            elif wanted:
                idx = torch.tensor(wanted)
                whole[idx, :, :, j] = self._typed(p).index_select(0, idx)
        whole = whole.to(self.device).view(len(lay.layers), 2, 1, lay.kv_heads, n * B, lay.head_dim)
        for pos, i in enumerate(lay.layers):
            first = starts[pos] * B
            yield i, whole[pos, 0][..., first:, :], whole[pos, 1][..., first:, :], n * B

    @property
    def _on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _device_states(self, payloads: Sequence[np.ndarray], starts: list[int] | None):
        """`_layer_states` for a model on a CUDA device: the payloads go up as they are stored, in one DMA
        from pinned memory, and are laid out per layer there.

        Why not lay them out on the host first, as on the CPU: that strided copy runs on one core
        at a few GB/s, while the device transposes at its memory bandwidth. A sliding layer still
        gets only its window's blocks."""
        lay, n, B = self.layout, len(payloads), self.layout.block_tokens
        rows = self._device_rows(payloads).view(self.dtype).view(n, *self.block_shape)
        if lay.kind == "latent":  # [n, L, B, W] -> [L, 1, 1, n * B, W]
            whole = rows.transpose(0, 1).contiguous().view(len(lay.layers), 1, 1, n * B, lay.head_dim)
            for pos, i in enumerate(lay.layers):
                yield i, whole[pos, ..., : self.latent_rank], whole[pos, ..., self.latent_rank :]
            return
        whole = rows.permute(1, 2, 3, 0, 4, 5).contiguous()  # [n, L, 2, H, B, D] -> [L, 2, H, n, B, D]
        whole = whole.view(len(lay.layers), 2, 1, lay.kv_heads, n * B, lay.head_dim)
        for pos, i in enumerate(lay.layers):
            first = (starts[pos] if starts else 0) * B
            if first:
                yield i, whole[pos, 0][..., first:, :], whole[pos, 1][..., first:, :], n * B
            else:
                yield i, whole[pos, 0], whole[pos, 1]

    def _device_rows(self, payloads: Sequence[np.ndarray]) -> torch.Tensor:
        """The payloads as one [n, block_bytes] uint8 tensor on the device.

        Payloads fetched into `landing` already sit side by side in pinned memory and go up as
        they are; others are gathered into a pinned upload buffer first."""
        n, size = len(payloads), self.block_bytes
        first = payloads[0]
        if isinstance(first, torch.Tensor) and first.device.type != "cpu":  # fetched straight to the device
            if all(p.data_ptr() == self._device_landing[j].data_ptr() for j, p in enumerate(payloads)):
                return self._device_landing[:n]
            return torch.stack([p.reshape(-1).view(torch.uint8)[:size] for p in payloads])
        host = self._landed_rows(payloads)
        if host is None:
            if self._upload.numel() < n * size:
                self._upload = torch.empty(n * size, dtype=torch.uint8, pin_memory=self._on_cuda)
            host = self._upload[: n * size].view(n, size)
            staged = host.numpy()
            for j, p in enumerate(payloads):
                staged[j] = np.asarray(p, dtype=np.uint8)[:size]
        if not self._on_cuda:  # (the same layout code runs on CPU tensors in the tests)
            return host.clone()
        rows = host.to(self.device, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # the pinned rows may be refilled once this returns
        return rows

    def _landed_rows(self, payloads: Sequence[np.ndarray]) -> torch.Tensor | None:
        """The payloads as `[n, block_bytes]` rows of the host landing buffer when each payload j is its row j
        (a fetch read them there), else None."""
        n, landing = len(payloads), self._landing
        if landing.shape[0] < n:
            return None
        start, step, size = landing.ctypes.data, landing.strides[0], self.block_bytes
        for j, p in enumerate(payloads):
            if not isinstance(p, np.ndarray) or p.nbytes != size or p.ctypes.data != start + j * step:
                return None
        return self._landing_rows[:n]

    def landing(self, blocks: int, on_device: bool = False) -> np.ndarray | torch.Tensor:
        """`blocks` reusable payload buffers for a fetch to read into (valid until the next fetch).

        With the model on a CUDA device: rows on the device when the store fills device buffers
        (`on_device`; its memory tiers DMA there and verify there), else pinned host rows, so the
        blocks go up in one DMA."""
        if on_device and self._on_cuda:
            if self._device_landing.shape[0] < blocks:
                self._device_landing = torch.empty((blocks, self.block_bytes), dtype=torch.uint8, device=self.device)
            return self._device_landing[:blocks]
        if self._landing.shape[0] < blocks:
            self._landing_rows = torch.empty((blocks, self.block_bytes), dtype=torch.uint8, pin_memory=self._on_cuda)
            self._landing = self._landing_rows.numpy()
        return self._landing[:blocks]

    def _buffer(self, shape: tuple[int, ...], reuse: bool) -> torch.Tensor:
        """The staging buffer viewed as `shape` (a fresh tensor unless reusing)."""
        if not reuse:
            return torch.empty(shape, dtype=self.dtype)
        need = int(np.prod(shape))
        if self._staging.numel() < need:
            with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
                self._staging = torch.empty(need, dtype=self.dtype)
        return self._staging[:need].view(shape)

    def _typed(self, payload: np.ndarray) -> torch.Tensor:
        """A payload's bytes as the block's typed tensor (no copy).

        Payloads from the Ray object store are read-only views; the tensor is only ever read, so
        torch's warning about non-writable arrays does not apply and is kept out of the logs."""
        data = np.asarray(payload, dtype=np.uint8)[: self.block_bytes]
        if data.flags.writeable:
            raw = torch.from_numpy(data)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                raw = torch.from_numpy(data)
        return raw.view(self.dtype).view(self.block_shape)

    @staticmethod
    def _set(layer, keys: torch.Tensor, values: torch.Tensor, total: int | None = None) -> None:
        """Install restored states as a layer that has seen `total` tokens (default: the states' length).

        Sliding layers carry their true count (`cumulative_length`) even when they hold only the
        window's tail: transformers derives their attention mask from it."""
        if not keys.is_contiguous():
            keys = keys.contiguous()
        if not values.is_contiguous():
            values = values.contiguous()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = keys.shape[-2] if total is None else total

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
        return payload is not None and payload.nbytes >= self.block_bytes


def _offset(layer) -> int:
    """Token index of the first token a cache layer still holds."""
    held = layer.keys.shape[-2] if layer.keys is not None and layer.keys.numel() else 0
    total = getattr(layer, "cumulative_length", None)
    return 0 if total is None else int(total) - held
