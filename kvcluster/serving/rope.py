"""Re-rotating cached RoPE keys so a KV block can be reused at another position.

A block cached while its tokens sat at positions p..p+T-1 can serve a prompt where
the same tokens sit at p+d..p+d+T-1: RoPE rotations compose, R(p + d) = R(d) R(p),
so rotating the cached keys by angle d * inv_freq gives exactly the keys the model
would have computed at the new positions. Values and un-rotated dims are untouched.

Only `inv_freq` is used, never the model's cos/sin tables: those are multiplied by
`attention_scaling` (YaRN's mscale, longrope's factor), which is already baked into
the cached keys and must not be applied a second time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeGeometry:
    """How a model's cached keys are rotated: enough to rotate them again.

    `cache_slot` says which tensor of a cache layer carries the rotated keys:
    "keys" for ordinary attention, "values" for DeepSeek MLA, whose cache keeps the
    position-free latent in the keys slot and the roped `k_pe` in the values slot.
    """

    inv_freq: torch.Tensor  # [rot_dim // 2], float32, from the model's rotary embedding buffer
    rot_dim: int  # leading dims of each key head that are rotated (< head_dim for partial rotary)
    interleaved: bool  # False: pairs (i, i + rot_dim/2) as in HF rotate_half; True: pairs (2i, 2i+1)
    cache_slot: str = "keys"


def _rotary_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's single rotary embedding module, or None if it has none (absolute positions)."""
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not found:
        return None
    with_freq = [m for m in found if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if len(with_freq) != len(found):
        # e.g. gemma3: one module holding `<layer_type>_inv_freq` buffers, a different RoPE per layer type.
        raise NotImplementedError("per-layer-type RoPE (no single inv_freq) is not supported")
    first = with_freq[0].inv_freq
    if any(m.inv_freq.shape != first.shape or not torch.equal(m.inv_freq, first) for m in with_freq[1:]):
        raise NotImplementedError("models with several different RoPE frequency sets are not supported")
    return with_freq[0]


def rope_geometry(model: torch.nn.Module) -> RopeGeometry | None:
    """Read the RoPE geometry of a loaded transformers CausalLM; None if it uses no RoPE.

    The rotated width is taken from `inv_freq` itself (2 per frequency): that is the
    width of the cos/sin the model applies, so partial rotary (phi, gpt_neox, stablelm:
    head_dim * partial_rotary_factor) and MLA (qk_rope_head_dim) come out right.

    The cached layout is always the rotate_half one for HF models, DeepSeek included:
    with `rope_interleave=True` HF reads q/k pe in pairs (2i, 2i+1) but writes the
    rotated result de-interleaved, `cat(even_rotated, odd_rotated)`, so the cached
    `k_pe` pairs dims (i, i + rot_dim/2). Hence `interleaved=False` here.

    Caveat: "dynamic" and "longrope" RoPE swap `inv_freq` with the sequence length,
    so this reads the frequencies currently in the buffer; re-rotation is only exact
    when the block was cached with the same frequencies.
    """
    rotary = _rotary_module(model)
    if rotary is None:
        return None
    inv_freq = rotary.inv_freq.detach().to(torch.float32).clone()
    rot_dim = 2 * inv_freq.numel()
    config = model.config
    is_mla = getattr(config, "kv_lora_rank", None) is not None and hasattr(config, "qk_rope_head_dim")
    if is_mla and rot_dim != config.qk_rope_head_dim:
        raise ValueError(f"inv_freq covers {rot_dim} dims but qk_rope_head_dim is {config.qk_rope_head_dim}")
    return RopeGeometry(
        inv_freq=inv_freq,
        rot_dim=rot_dim,
        interleaved=False,
        cache_slot="values" if is_mla else "keys",
    )


def rerotate(keys: torch.Tensor, delta: int | torch.Tensor, geom: RopeGeometry) -> torch.Tensor:
    """Return `keys` ([..., T, head_dim]) moved by `delta` positions (int, or a [T] tensor per token).

    Only the first `geom.rot_dim` dims are rotated; the rest pass through. The math is
    done in (at least) float32 and cast back, so bf16/fp16 caches lose no more than
    one rounding. A negative delta moves a block earlier.
    """
    if isinstance(delta, int) and delta == 0:
        return keys.clone()
    if keys.shape[-1] < geom.rot_dim:
        raise ValueError(f"keys have {keys.shape[-1]} dims, fewer than rot_dim={geom.rot_dim}")
    work = torch.promote_types(keys.dtype, torch.float32)
    delta_t = torch.as_tensor(delta, device=keys.device).to(work)
    angles = delta_t.unsqueeze(-1) * geom.inv_freq.to(device=keys.device, dtype=work)  # [..., rot/2]
    cos, sin = angles.cos(), angles.sin()

    x = keys.to(work)
    rot, rest = x[..., : geom.rot_dim], x[..., geom.rot_dim :]
    if geom.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = geom.rot_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, rest), dim=-1).to(keys.dtype)
