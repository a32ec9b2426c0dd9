"""Re-rotating cached RoPE keys matches what the model computes at the shifted positions.

RoPE attention depends only on relative positions, so the same tokens run at
positions 0..T-1 and at d..d+T-1 give the same hidden states, and every layer's
cached keys differ exactly by a rotation of d positions. Tiny random models.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kvcluster.serving.rope import RopeGeometry, rerotate, rope_geometry

T = 6
DELTA = 300
ATOL = 1e-4
VOCAB = 1000

_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=512,
)
_DEEPSEEK = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=128,
    moe_intermediate_size=64,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    max_position_embeddings=512,
)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128)

# name -> (model_type, config kwargs, expected rot_dim, expected cache slot)
MODELS = {
    "llama": ("llama", dict(_SMALL, num_key_value_heads=2), 16, "keys"),
    "llama_yarn": ("llama", dict(_SMALL, num_key_value_heads=2, rope_parameters=_YARN), 16, "keys"),
    "llama3": (
        "llama",
        dict(
            _SMALL,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=128,
            ),
        ),
        16,
        "keys",
    ),
    "phi_partial": ("phi", dict(_SMALL, partial_rotary_factor=0.5), 8, "keys"),
    "gpt_neox_partial": ("gpt_neox", dict(_SMALL, rotary_pct=0.5), 8, "keys"),
    "deepseek_v3": ("deepseek_v3", _DEEPSEEK, 16, "values"),
    "deepseek_v3_no_interleave": ("deepseek_v3", dict(_DEEPSEEK, rope_interleave=False), 16, "values"),
    "deepseek_v3_yarn": ("deepseek_v3", dict(_DEEPSEEK, rope_parameters=_YARN), 16, "values"),
}

_built: dict[str, torch.nn.Module] = {}


def model(name: str) -> torch.nn.Module:
    """Build (once) a tiny random-weight float32 model."""
    if name not in _built:
        model_type, kwargs, _, _ = MODELS[name]
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(model_type, **kwargs)
        _built[name] = AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    return _built[name]


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def run(m: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache=None):
    return m(ids, position_ids=positions.view(1, -1), cache=cache, use_cache=True)


def rotated_and_other(layer, geom: RopeGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache tensor holding roped keys, the other one)."""
    if geom.cache_slot == "values":
        return layer.values, layer.keys
    return layer.keys, layer.values


@pytest.mark.parametrize("name", list(MODELS))
def test_geometry(name):
    _, _, rot_dim, slot = MODELS[name]
    geom = rope_geometry(model(name))
    assert geom is not None
    assert geom.rot_dim == rot_dim and geom.cache_slot == slot
    assert geom.inv_freq.shape == (rot_dim // 2,) and geom.inv_freq.dtype == torch.float32
    assert geom.interleaved is False  # HF caches rotated keys in the rotate_half layout, DeepSeek too


def test_yarn_variants_really_scale_attention():
    """The yarn cases only test something if cos/sin carry an mscale != 1."""
    for name in ("llama_yarn", "deepseek_v3_yarn"):
        rotary = model(name).model.rotary_emb
        assert abs(rotary.attention_scaling - 1.0) > 0.05


@pytest.mark.parametrize("name", list(MODELS))
def test_rerotated_cache_matches_shifted_run(name):
    m = model(name)
    geom = rope_geometry(m)
    ids = tokens()
    at_0 = run(m, ids, torch.arange(T))
    at_d = run(m, ids, torch.arange(T) + DELTA)
    torch.testing.assert_close(at_0.logits, at_d.logits, atol=ATOL, rtol=0)

    for layer_0, layer_d in zip(at_0.cache.layers, at_d.cache.layers, strict=True):
        rot_0, other_0 = rotated_and_other(layer_0, geom)
        rot_d, other_d = rotated_and_other(layer_d, geom)
        assert not torch.allclose(rot_0, rot_d, atol=1e-2)  # the shift is visible ...
        torch.testing.assert_close(rerotate(rot_0, DELTA, geom), rot_d, atol=ATOL, rtol=0)  # ... and undone
        torch.testing.assert_close(rerotate(rot_d, -DELTA, geom), rot_0, atol=ATOL, rtol=0)  # moving earlier
        # values (llama, partial) / the MLA latent (deepseek) do not depend on position at all
        torch.testing.assert_close(other_0, other_d, atol=ATOL, rtol=0)
        # partial rotary: the dims after rot_dim are not rotated
        torch.testing.assert_close(rot_0[..., geom.rot_dim :], rot_d[..., geom.rot_dim :], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama_yarn", "phi_partial", "deepseek_v3"])
def test_rerotated_cache_gives_same_next_token_logits(name):
    """A cache built at 0..T-1 and moved to d..d+T-1 decodes like one computed at d..d+T-1."""
    m = model(name)
    geom = rope_geometry(m)
    ids = tokens()
    nxt = torch.tensor([[7]])

    direct = run(m, ids, torch.arange(T) + DELTA)
    want = run(m, nxt, torch.tensor([DELTA + T]), cache=direct.cache).logits

    at_0 = run(m, ids, torch.arange(T))
    moved = []
    for layer in at_0.cache.layers:
        if geom.cache_slot == "values":
            moved.append((layer.keys, rerotate(layer.values, DELTA, geom)))
        else:
            moved.append((rerotate(layer.keys, DELTA, geom), layer.values))
    cache = DynamicCache(ddp_cache_data=moved)
    assert cache.get_seq_length() == T
    got = run(m, nxt, torch.tensor([DELTA + T]), cache=cache).logits

    stale = run(m, nxt, torch.tensor([DELTA + T]), cache=run(m, ids, torch.arange(T)).cache).logits
    assert not torch.allclose(stale, want, atol=1e-3)  # without re-rotation the positions are wrong
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "phi_partial", "deepseek_v3"])
def test_per_token_delta(name):
    """Layer 0 keys depend only on each token and its own position, so any per-token move is exact."""
    m = model(name)
    geom = rope_geometry(m)
    ids = tokens()
    new_pos = torch.tensor([3, 10, 11, 40, 41, 200])
    rot_0, _ = rotated_and_other(run(m, ids, torch.arange(T)).cache.layers[0], geom)
    rot_new, _ = rotated_and_other(run(m, ids, new_pos).cache.layers[0], geom)
    torch.testing.assert_close(rerotate(rot_0, new_pos - torch.arange(T), geom), rot_new, atol=ATOL, rtol=0)


def test_interleaved_flag_is_wrong_for_hf_deepseek_cache():
    """HF de-interleaves k_pe while rotating it, so the cache pairs dims (i, i + half), not (2i, 2i+1)."""
    m = model("deepseek_v3")
    assert m.config.rope_interleave is True
    assert model("deepseek_v3_no_interleave").config.rope_interleave is False  # both layouts are covered
    geom = rope_geometry(m)
    ids = tokens()
    k_0 = run(m, ids, torch.arange(T)).cache.layers[0].values
    k_d = run(m, ids, torch.arange(T) + DELTA).cache.layers[0].values
    pairwise = RopeGeometry(geom.inv_freq, geom.rot_dim, interleaved=True, cache_slot="values")
    assert not torch.allclose(rerotate(k_0, DELTA, pairwise), k_d, atol=1e-2)


def test_interleaved_layout_is_the_permuted_half_layout():
    """Pairs (2i, 2i+1) rotated in place == de-interleave, rotate_half-style rotation, re-interleave."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    half = RopeGeometry(inv_freq, 8, interleaved=False)
    pairs = RopeGeometry(inv_freq, 8, interleaved=True)
    x = torch.randn(2, 3, T, 12, generator=torch.Generator().manual_seed(2))
    perm = torch.cat((torch.arange(0, 8, 2), torch.arange(1, 8, 2), torch.arange(8, 12)))
    inverse = torch.argsort(perm)
    want = rerotate(x[..., perm], 17, half)[..., inverse]
    torch.testing.assert_close(rerotate(x, 17, pairs), want, atol=1e-5, rtol=0)


def _geom() -> tuple[RopeGeometry, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    keys = torch.randn(1, 2, T, 16, generator=torch.Generator().manual_seed(3))
    return RopeGeometry(inv_freq, 8, interleaved=False), keys


def test_delta_zero_is_identity():
    geom, keys = _geom()
    out = rerotate(keys, 0, geom)
    assert out is not keys and torch.equal(out, keys)
    assert torch.equal(rerotate(keys, torch.zeros(T, dtype=torch.long), geom), keys)


def test_rotations_compose_and_preserve_norm():
    geom, keys = _geom()
    torch.testing.assert_close(rerotate(rerotate(keys, 50, geom), -20, geom), rerotate(keys, 30, geom))
    torch.testing.assert_close(rerotate(keys, 123, geom).norm(dim=-1), keys.norm(dim=-1))


def test_low_precision_keys_keep_their_dtype():
    geom, keys = _geom()
    out = rerotate(keys.to(torch.bfloat16), 77, geom)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), rerotate(keys, 77, geom), atol=3e-2, rtol=0)


def test_gpt2_has_no_rope():
    cfg = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    assert rope_geometry(AutoModelForCausalLM.from_config(cfg)) is None
