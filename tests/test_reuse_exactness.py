"""Exact prefix reuse stays exact after a position-independent (`kv_reuse: anywhere`) segment hit.

A segment served from another offset is re-rotated: only its layer 0 equals what prefill
computes, and every later token attended to it. None of that KV may be stored under the
exact prefix keys, or a later plain request for the same prompt would be served approximate KV.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcluster.serving.block_store import LocalBlockStore
from kvcluster.serving.models import load_model
from kvcluster.serving.runner import ModelRunner
from kvcluster.serving.sampling import SamplingParams
from kvcluster.storage import dram_backend, hbm_backend, layout_for
from kvcluster.storage.tiered import TieredStore

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["kvcluster-tiny-llama", "kvcluster-tiny-mla"])
def loaded(request):
    return load_model(request.param)


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.RandomState(seed).randint(3, 32000, n)]


def cached_runner(loaded) -> ModelRunner:
    block = layout_for(loaded.spec, 16, loaded.dtype).nbytes()
    return ModelRunner(loaded, LocalBlockStore(TieredStore([hbm_backend(64, block), dram_backend(256, block)], block)))


def cold_blocks(loaded, tokens: list[int], blocks: int) -> list[np.ndarray]:
    """The first `blocks` payloads of a full prefill with no cache at all."""
    codec = ModelRunner(loaded).codec
    with torch.inference_mode():
        cache = codec.new_cache()
        loaded.model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    return codec.encode(cache, 0, blocks)


def assert_same_kv(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g, w = (torch.from_numpy(np.array(p)).view(torch.float32) for p in (got, want))
    assert torch.allclose(g, w, atol=1e-4), (what, float((g - w).abs().max()))


DOC = prompt(64, seed=7)
FIRST = prompt(40, seed=8) + DOC + prompt(10, seed=9)  # caches the document (segment) at offset 40
SECOND = prompt(23, seed=10) + DOC + prompt(12, seed=11)  # the same document at 23: not block-aligned


def test_a_plain_request_after_a_segment_hit_is_served_exact_kv(loaded):
    runner = cached_runner(loaded)
    runner.complete(FIRST, GREEDY, segments=[(40, 104)])
    hit = runner.complete(SECOND, GREEDY, segments=[(23, 87)])
    assert hit.cached_tokens == 0 and hit.segment_tokens == 64
    assert hit.stored_blocks == 1  # tokens 0..15 only: block 1 (16..31) already holds re-rotated tokens from 23

    stored = runner.store.fetch(runner.block_keys(SECOND[:96]))  # every full block a plain request could reuse
    assert len(stored) == 1
    for j, (got, want) in enumerate(zip(stored, cold_blocks(loaded, SECOND, len(stored)))):
        assert_same_kv(got, want, f"block {j}")

    cold = ModelRunner(loaded).complete(SECOND, GREEDY)
    plain = runner.complete(SECOND, GREEDY)  # exact-prefix reuse only
    assert plain.cached_tokens == 16 and plain.segment_tokens == 0
    assert plain.output_ids == cold.output_ids
    again = runner.complete(SECOND, GREEDY)  # the plain request stored its exactly computed blocks
    assert again.cached_tokens == 96 and again.output_ids == cold.output_ids
    stored = runner.store.fetch(runner.block_keys(SECOND[:96]))
    assert len(stored) == 6
    for j, (got, want) in enumerate(zip(stored, cold_blocks(loaded, SECOND, 6))):
        assert_same_kv(got, want, f"block {j} after the plain request")


def test_logits_after_the_exact_prefix_equal_a_cold_prefill(loaded):
    """Stronger than greedy equality: next-token logits over whatever the prefix keys serve after a segment hit."""
    runner = cached_runner(loaded)
    runner.complete(FIRST, GREEDY, segments=[(40, 104)])
    runner.complete(SECOND, GREEDY, segments=[(23, 87)])
    payloads = runner.store.fetch(runner.block_keys(SECOND[:96]))
    with torch.inference_mode():
        warm_cache = runner.codec.decode(payloads)
        rest = torch.tensor([SECOND[len(payloads) * 16:]])
        warm = loaded.model(input_ids=rest, cache=warm_cache, use_cache=True).logits[0, -1]
        cold = loaded.model(input_ids=torch.tensor([SECOND]), use_cache=True).logits[0, -1]
    assert torch.allclose(warm, cold, atol=1e-4), float((warm - cold).abs().max())


def test_the_segment_store_still_serves_the_document_at_a_third_offset(loaded):
    runner = cached_runner(loaded)
    runner.complete(FIRST, GREEDY, segments=[(40, 104)])
    runner.complete(SECOND, GREEDY, segments=[(23, 87)])
    third = prompt(50, seed=12) + DOC + [5]
    gen = runner.start(third, GREEDY, segments=[(50, 114)])
    assert gen.cached_tokens == 0 and gen.segment_tokens == 64
    runner.finish(gen)
    assert gen.stored_blocks == 3  # 0..47 precede the document at 50


def test_blocks_before_the_first_segment_hit_and_a_whole_miss_are_stored_as_before(loaded):
    """A segment that misses leaves everything exact: all of the request's full blocks go under prefix keys."""
    runner = cached_runner(loaded)
    miss = runner.complete(SECOND, GREEDY, segments=[(23, 87)])  # nothing cached yet: the document is computed
    assert miss.segment_tokens == 0
    assert miss.stored_blocks == (len(SECOND) + GREEDY.max_tokens - 1) // 16
