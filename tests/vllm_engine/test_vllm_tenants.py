"""Tenants under the vLLM connector: a request loads from kvcluster only blocks stored under its own `cache_salt`.

vLLM salts its own prefix cache too, so a check through the engine's output cannot see kvcluster's part: each
test empties vLLM's cache (`reset_prefix_cache`) before the request it checks, so only the connector can answer,
and reads what it loaded (`num_cached_tokens`, the store's counters). One engine serves the module (a start
costs seconds on two cores); its tier is a directory of block files, which a fresh engine adopts.
Runs in .venv-vllm, as tests/vllm_engine/test_vllm_connector.py does, whose engine helpers it shares.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_vllm_connector import BLOCK, close, engine, engines_closed, model_dir, vllm  # noqa: F401 - fixtures
# (importing test_vllm_connector sets the engine's environment and imports vllm, or skips)

pytestmark = pytest.mark.timeout(300)
BLOCKS = 4  # full blocks of each prompt a later request can load (its last token is always computed)


def prompt_of(seed: int) -> list[int]:
    """A prompt of BLOCKS full blocks and a tail, its own for each test (the tier outlives the tests)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(BLOCKS * BLOCK + 50)]


def run(llm, prompt: list[int], salt: str) -> tuple[list[int], int]:
    """Greedy tokens of `prompt` for the tenant `salt` ("": a request naming no salt), and the prompt tokens
    the engine did not compute."""
    request = {"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt else {})
    out = llm.generate([request], vllm.SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


class Engines:
    """The module's engine, one at a time (vLLM keeps its connector in a process global), on one tier of block
    files: `fresh` closes it and starts another on the same directory."""

    def __init__(self, model_dir: Path, files: Path) -> None:
        self.model_dir = model_dir
        self.tiers = [{"kind": "pfs", "capacity": "64MiB", "path": str(files)}]  # 64 blocks of 1 MiB
        self.llm = self.shared = None

    def current(self):
        if self.llm is None:
            self.llm, self.shared = engine(self.model_dir, self.tiers, across_tests=True)  # the module's fixture closes it
        return self.llm, self.shared

    def fresh(self):
        self.close()
        return self.current()

    def close(self) -> None:
        if self.llm is not None:
            close(self.llm)
            self.llm = self.shared = None


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    held = Engines(model_dir, tmp_path_factory.mktemp("tenant-files"))
    yield held
    held.close()


def forget_in_vllm(llm) -> None:
    """vLLM's own prefix cache emptied: the next request's prefix can come from kvcluster only."""
    assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache (a request still holds blocks)"


@pytest.mark.parametrize("owner, other, seed", [("tenant-a", "tenant-b", 11), ("", "tenant-a", 12),
                                                ("tenant-a", "", 13)],
                         ids=["salted-then-other-salt", "unsalted-then-salted", "salted-then-unsalted"])
def test_a_request_never_loads_the_blocks_another_salt_stored(engines, owner, other, seed) -> None:
    """The owner's request stores its blocks; another salt's request of the same tokens loads none of them
    and stores a copy of its own; the owner's next request loads all of its own."""
    llm, shared = engines.current()
    prompt = prompt_of(seed)
    cold, cached = run(llm, prompt, owner)
    assert cached == 0
    shared.wait_saved()
    loaded, saved = shared.loaded_blocks, shared.saved_blocks

    forget_in_vllm(llm)
    tokens, cached = run(llm, prompt, other)
    assert cached == 0 and shared.loaded_blocks == loaded  # no hit promised, nothing read
    assert tokens == cold  # computed, as the owner's was
    assert shared.saved_blocks == saved + BLOCKS  # under its own keys: the owner's did not count as held
    shared.wait_saved()

    forget_in_vllm(llm)
    tokens, cached = run(llm, prompt, owner)
    assert cached == BLOCKS * BLOCK and shared.loaded_blocks == loaded + BLOCKS
    assert tokens == cold
    assert shared.failed_blocks == 0


def test_a_fresh_engine_on_the_same_block_files_loads_them_for_their_tenant_alone(engines) -> None:
    """Tenant A's blocks outlive its engine as files; a fresh engine adopts them and loads them for A's salt,
    never for B's or for a request naming no salt."""
    llm, shared = engines.current()
    prompt = prompt_of(1001)
    cold, cached = run(llm, prompt, "tenant-a")
    assert cached == 0
    shared.wait_saved()

    llm, shared = engines.fresh()  # only the block files remain
    for salt in ("tenant-b", ""):
        tokens, cached = run(llm, prompt, salt)
        assert (cached, shared.loaded_blocks) == (0, 0), f"salt {salt!r} loaded tenant-a's blocks"
        assert tokens == cold
        shared.wait_saved()
        forget_in_vllm(llm)
    tokens, cached = run(llm, prompt, "tenant-a")
    assert (cached, shared.loaded_blocks, shared.failed_blocks) == (BLOCKS * BLOCK, BLOCKS, 0)
    assert tokens == cold
