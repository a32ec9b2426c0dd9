"""The model runner: cached prefixes give exactly the uncached output, for every attention kind."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvcluster.serving.block_store import LocalBlockStore
from kvcluster.serving.models import load_model
from kvcluster.serving.rope import rope_geometry
from kvcluster.serving.runner import ModelRunner, RequestTooLong
from kvcluster.serving.sampling import SamplingParams
from kvcluster.storage import dram_backend, hbm_backend, layout_for
from kvcluster.storage.tiered import TieredStore

MODELS = ["kvcluster-tiny-llama", "kvcluster-tiny-sliding", "kvcluster-tiny-mla"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=MODELS + ["kvcluster-tiny-llama:bf16"])
def loaded(request):
    name, _, dtype = request.param.partition(":")
    return load_model(name, dtype=dtype or "fp32")


def cached_runner(loaded, hbm_blocks: int = 64, dram_blocks: int = 256) -> ModelRunner:
    block = layout_for(loaded.spec, 16, loaded.dtype).nbytes()
    tiers = TieredStore([hbm_backend(hbm_blocks, block), dram_backend(dram_blocks, block)], block)
    return ModelRunner(loaded, LocalBlockStore(tiers))


def restored_and_cold_logits(loaded, runner: ModelRunner, tokens: list[int], blocks: int):
    """(the restored cache, next-token logits after restoring `blocks` cached blocks, logits of a full prefill)."""
    payloads = runner.store.fetch(runner.block_keys(tokens[: blocks * 16]))
    assert len(payloads) == blocks
    with torch.inference_mode():
        restored = runner.codec.decode(payloads)
        rest = torch.tensor([tokens[blocks * 16:]])
        warm = loaded.model(input_ids=rest, cache=restored, use_cache=True).logits[0, -1]
        cold = loaded.model(input_ids=torch.tensor([tokens]), use_cache=True).logits[0, -1]
    return restored, warm, cold


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.RandomState(seed).randint(3, 32000, n)]


def test_cache_hit_output_equals_cold_output(loaded):
    cold, warm = ModelRunner(loaded), cached_runner(loaded)
    first = prompt(150)
    reference = cold.complete(first, GREEDY)
    miss = warm.complete(first, GREEDY)
    hit = warm.complete(first, GREEDY)
    assert miss.cached_tokens == 0 and hit.cached_tokens == 144  # 9 full blocks; the last token is computed
    assert reference.output_ids == miss.output_ids == hit.output_ids
    assert reference.text == hit.text

    second = first + hit.output_ids + prompt(40, seed=1)  # the next turn: history + answer + new message
    turn = warm.complete(second, GREEDY)
    assert turn.cached_tokens == (len(first) + len(hit.output_ids) - 1) // 16 * 16
    assert turn.output_ids == cold.complete(second, GREEDY).output_ids


def test_cached_logits_match(loaded):
    """Stronger than greedy equality: the next-token logits after a restored prefix."""
    runner = cached_runner(loaded)
    tokens = prompt(97, seed=3)
    runner.complete(tokens, GREEDY)
    _, warm, cold = restored_and_cold_logits(loaded, runner, tokens, 6)
    tol = 2e-2 if loaded.dtype == "bf16" else 1e-4
    assert torch.allclose(warm.float(), cold.float(), atol=tol), float((warm - cold).abs().max())


def test_payload_is_the_layout_and_mla_stores_only_the_latent(loaded):
    runner = cached_runner(loaded)
    tokens = prompt(40)
    gen = runner.start(tokens, GREEDY)
    payloads = runner.codec.encode(gen.cache, 0, 2)
    lay, cfg = runner.layout, loaded.model.config
    assert all(p.dtype == np.uint8 and p.nbytes == lay.nbytes() for p in payloads)
    if lay.kind == "latent":
        assert lay.head_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
        per_token = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        assert lay.nbytes() == cfg.num_hidden_layers * 16 * per_token * 4  # fp32 latent, nothing decompressed
        decompressed = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        assert decompressed > per_token  # per-head K/V would be larger than what is stored
    layer0 = gen.cache.layers[0].keys[0, :, :16]
    typed = torch.from_numpy(payloads[0]).view(runner.codec.dtype).view(*lay.shape())
    stored = typed[0, :, : runner.codec.latent_rank][None] if lay.kind == "latent" else typed[0, 0]
    assert torch.equal(stored, layer0)  # raw bits, bf16 included


def test_tenants_never_share_blocks(loaded):
    runner = cached_runner(loaded)
    tokens = prompt(80)
    runner.complete(tokens, GREEDY, cache_salt="tenant-a")
    assert runner.complete(tokens, GREEDY, cache_salt="tenant-b").cached_tokens == 0
    assert runner.complete(tokens, GREEDY, cache_salt="tenant-a").cached_tokens == 64


class WrongSizeStore:
    """A store returning a truncated payload in the middle of the run: the rest must be recomputed."""

    def __init__(self, inner):
        self.inner = inner

    def fetch(self, keys, out=None):
        got = self.inner.fetch(keys, out)
        truncated = np.frombuffer(np.ascontiguousarray(got[2]).tobytes()[:100], dtype=np.uint8) if len(got) > 3 else None
        return got[:2] + [truncated] + got[3:] if len(got) > 3 else got

    def store(self, keys, payloads, pairs=None, finish="", output_tokens=0, session=""):
        self.inner.store(keys, payloads, pairs, finish, output_tokens, session)


def test_a_bad_payload_is_a_miss_not_wrong_output():
    loaded = load_model("kvcluster-tiny-llama")
    warm = cached_runner(loaded)
    tokens = prompt(100)
    warm.complete(tokens, GREEDY)
    broken = ModelRunner(loaded, WrongSizeStore(warm.store))
    gen = broken.complete(tokens, GREEDY)
    assert gen.cached_tokens == 32
    assert gen.output_ids == ModelRunner(loaded).complete(tokens, GREEDY).output_ids


def test_sampling_is_repeatable_with_a_seed_and_stops_on_strings():
    loaded = load_model("kvcluster-tiny-llama")
    runner = ModelRunner(loaded)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    a, b = runner.complete(prompt(20), params), runner.complete(prompt(20), params)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 10 and a.finish_reason == "length"
    greedy = runner.complete(prompt(20), GREEDY)
    stop = greedy.text[3:6]
    cut = runner.complete(prompt(20), GREEDY.model_copy(update={"stop": (stop,)}))
    assert cut.finish_reason == "stop" and cut.text == greedy.text[: greedy.text.find(stop)]
    deltas = list(runner.generate(prompt(20), GREEDY.model_copy(update={"stop": (stop,)})))
    assert "".join(deltas) == cut.text


def test_prompt_over_the_context_window_is_refused():
    loaded = load_model("kvcluster-tiny-llama")
    runner = ModelRunner(loaded)
    with pytest.raises(RequestTooLong, match="context window is 4096"):
        runner.start(prompt(4090), SamplingParams(max_tokens=10))
    with pytest.raises(RequestTooLong, match="empty"):
        runner.start([], GREEDY)


@pytest.mark.parametrize("name", MODELS)
def test_rerotated_payloads_equal_payloads_computed_at_the_new_position(name):
    """A block moved by `delta` positions: its stored keys re-rotated equal the keys computed there."""
    loaded = load_model(name)
    runner = ModelRunner(loaded)
    geom = rope_geometry(loaded.model)
    tokens, delta = torch.tensor([prompt(32)]), 200
    with torch.inference_mode():
        at_zero, at_delta = runner.codec.new_cache(), runner.codec.new_cache()
        loaded.model(input_ids=tokens, cache=at_zero, use_cache=True)
        loaded.model(input_ids=tokens, position_ids=torch.arange(32)[None] + delta, cache=at_delta, use_cache=True)
    moved = runner.codec.rerotate(runner.codec.encode(at_zero, 0, 2), delta, geom)
    expected = runner.codec.encode(at_delta, 0, 2)
    lay = runner.layout
    for got, want in zip(moved, expected):
        g = torch.from_numpy(got).view(torch.float32)
        w = torch.from_numpy(want).view(torch.float32)
        assert torch.allclose(g, w, atol=1e-4), float((g - w).abs().max())
    stale = torch.from_numpy(runner.codec.encode(at_zero, 0, 1)[0]).view(torch.float32)
    assert not torch.allclose(stale, torch.from_numpy(expected[0]).view(torch.float32), atol=1e-2)
    assert lay.nbytes() == moved[0].nbytes


@pytest.mark.parametrize("name", MODELS)
def test_a_segment_cached_at_one_offset_is_reused_at_another_with_rerotated_keys(name):
    """RoPE-aware reuse in the runner: a document cached after one prefix is spliced in after another.

    Its stored keys were rotated back to position 0 and are rotated to the new offset on fetch, so layer 0
    (whose keys depend only on token and position) holds exactly what prefill computes there."""
    loaded = load_model(name)
    runner = cached_runner(loaded)
    doc = prompt(64, seed=7)
    first = prompt(40, seed=8) + doc + prompt(10, seed=9)
    second = prompt(23, seed=10) + doc + prompt(12, seed=11)
    runner.complete(first, GREEDY, segments=[(40, 104)])
    gen = runner.start(second, GREEDY, segments=[(23, 87)])
    assert gen.cached_tokens == 0 and gen.segment_tokens == 64
    cold = ModelRunner(loaded)
    with torch.inference_mode():
        reference = cold.codec.new_cache()
        loaded.model(input_ids=torch.tensor([second]), cache=reference, use_cache=True)
    for slot in ("keys", "values"):
        got = getattr(gen.cache.layers[0], slot)[0, :, 23:87]
        want = getattr(reference.layers[0], slot)[0, :, 23:87]
        assert torch.allclose(got, want, atol=1e-4), (slot, float((got - want).abs().max()))
    runner.finish(gen)
    unrotated = runner.codec.encode(reference, 0, 1, start_token=23)
    canonical = runner.codec.rerotate(unrotated, -23, runner.rope)
    assert not np.array_equal(unrotated[0], canonical[0])  # the stored copy sits at position 0, not 23


def test_segments_are_tenant_scoped_and_need_a_full_block():
    loaded = load_model("kvcluster-tiny-llama")
    runner = cached_runner(loaded)
    doc = prompt(48, seed=12)
    runner.complete(prompt(20, seed=13) + doc + [5], GREEDY, cache_salt="a", segments=[(20, 68)])
    other = runner.start(prompt(30, seed=14) + doc + [6], GREEDY, cache_salt="b", segments=[(30, 78)])
    assert other.segment_tokens == 0  # another tenant's document is never reused
    short = runner.start(prompt(30, seed=14) + doc + [6], GREEDY, cache_salt="a", segments=[(30, 40)])
    assert short.segment_tokens == 0 and short.segments == []


def test_per_layer_rope_model_reuses_prefixes_and_turns_segments_off(tmp_path):
    """gemma-3 keeps a different RoPE per layer type: segments cannot be re-rotated with one frequency set, so
    they are skipped (computed), while prefix reuse over its hybrid sliding/global cache still gives exact logits."""
    config = dict(model_type="gemma3_text", vocab_size=32000, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  sliding_window=32, max_position_embeddings=1024)
    path = tmp_path / "tiny-gemma3.json"
    path.write_text(json.dumps(config))
    loaded = load_model(str(path))
    with pytest.raises(NotImplementedError):
        rope_geometry(loaded.model)
    runner = cached_runner(loaded)
    assert runner.rope is None
    doc = prompt(48, seed=15)
    tokens = prompt(33, seed=16) + doc + [7]
    first = runner.start(tokens, GREEDY, segments=[(33, 81)])
    assert first.segment_tokens == 0 and first.segments == []
    runner.finish(first)
    _, warm, cold = restored_and_cold_logits(loaded, runner, tokens, 5)
    assert torch.allclose(warm, cold, atol=1e-4), float((warm - cold).abs().max())


def test_a_restore_gives_sliding_layers_only_the_window_they_still_see():
    """Mistral-style sliding layers (window 64) attend to their last 63 tokens: a 192-token prefix restores only
    the blocks covering those, with the true token count, and the next-token logits equal a full prefill."""
    loaded = load_model("kvcluster-tiny-sliding")
    runner = cached_runner(loaded)
    tokens = prompt(193, seed=21)
    runner.complete(tokens, GREEDY)
    with torch.inference_mode():  # the restored layers as decode left them, before a forward extends them
        for layer in runner.codec.decode(runner.store.fetch(runner.block_keys(tokens[:192]))).layers:
            assert layer.cumulative_length == 192
            assert 63 <= layer.keys.shape[-2] <= 63 + 15  # blocks 8..11: the window's tail, not all 12 blocks
    _, warm, cold = restored_and_cold_logits(loaded, runner, tokens, 12)
    assert torch.allclose(warm, cold, atol=1e-4), float((warm - cold).abs().max())
    hit = runner.complete(tokens + [9] * 40, GREEDY)  # decoding on from a windowed restore, then write-back
    assert hit.cached_tokens == 192
    assert hit.output_ids == ModelRunner(loaded).complete(tokens + [9] * 40, GREEDY).output_ids


class RecordingStore:
    """Passes through, remembering how each stored request's answer ended."""

    def __init__(self, inner):
        self.inner, self.answers = inner, []

    def fetch(self, keys, out=None):
        return self.inner.fetch(keys, out)

    def store(self, keys, payloads, pairs=None, finish="", output_tokens=0, session=""):
        self.answers.append((finish, output_tokens, session))
        self.inner.store(keys, payloads, pairs, finish, output_tokens, session)


def test_the_store_learns_how_each_answer_ended_and_whose_request_it_was():
    loaded = load_model("kvcluster-tiny-llama")
    store = RecordingStore(cached_runner(loaded).store)
    runner = ModelRunner(loaded, store)
    runner.complete(prompt(100), GREEDY)  # runs to max_tokens: finish "length"
    runner.complete(prompt(100), GREEDY, session="tenant/alice")
    assert store.answers == [("length", 12, ""), ("length", 12, "tenant/alice")]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("landed", [True, False])
def test_the_device_restore_lays_blocks_out_as_the_host_restore_does(name, landed):
    """On a CUDA device the payloads go up as stored and are transposed there (`_device_states`); that layout code
    runs here on CPU tensors and must give every layer exactly the states of the host path, windows included."""
    loaded = load_model(name)
    runner = cached_runner(loaded)
    tokens = prompt(193, seed=22)
    runner.complete(tokens, GREEDY)
    keys = runner.block_keys(tokens[:192])
    codec = runner.codec
    payloads = runner.store.fetch(keys, codec.landing(len(keys)) if landed else None)
    assert len(payloads) == 12
    starts = codec._window_starts(12) if codec.layout.kind != "latent" else None
    host = list(codec._layer_states(payloads, reuse=False, window_aware=True))
    device = list(codec._device_states(payloads, starts))
    assert [s[0] for s in device] == [s[0] for s in host] == list(codec.layout.layers)
    for h, d in zip(host, device):
        assert len(h) == len(d) or (len(h) == 4 and h[3] == d[1].shape[-2])  # a full layer's count is its length
        assert torch.equal(h[1], d[1]) and torch.equal(h[2], d[2])


@pytest.mark.parametrize("name", MODELS)
def test_payloads_fetched_side_by_side_restore_as_separate_payloads_do(name):
    """Payloads a fetch read into the landing rows are laid out per layer in one copy; only payload j in row j
    counts as landed, and the states equal those of the same bytes restored block by block."""
    runner = cached_runner(load_model(name))
    tokens = prompt(193, seed=23)
    runner.complete(tokens, GREEDY)
    codec = runner.codec
    landed = runner.store.fetch(runner.block_keys(tokens[:192]), codec.landing(12))
    apart = [np.array(p) for p in landed]
    assert codec._landed_rows(landed) is not None
    assert codec._landed_rows(apart) is None and codec._landed_rows(landed[::-1]) is None
    assert codec._landed_rows(landed[:11] + apart[11:]) is None
    one = list(codec._layer_states(landed, reuse=False, window_aware=True))
    each = list(codec._layer_states(apart, reuse=False, window_aware=True))
    assert [s[0] for s in one] == [s[0] for s in each] == list(codec.layout.layers)
    for a, b in zip(one, each):
        assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and a[3:] == b[3:]
