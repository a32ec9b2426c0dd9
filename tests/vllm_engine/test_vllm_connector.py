"""KVClusterConnector under a real vLLM engine: a prefix served from kvcluster's tiers gives vLLM's own output.

The reference for a prefix loaded from kvcluster is the same prompt served from vLLM's own prefix cache:
the same KV bytes through the same kernels, so the log-probabilities must match bit for bit; the greedy
tokens must match a cold recompute. Runs in .venv-vllm (built by `bash scripts/setup.sh`): the engine's CPU
build needs a transformers release the main venv does not carry. The main suite runs this directory there
(tests/test_vllm_engine.py); by hand: `.venv-vllm/bin/python -m pytest -q tests/vllm_engine`.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler, worker and test in one process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed here; run `bash scripts/setup.sh` and "
                   "`.venv-vllm/bin/python -m pytest -q tests/vllm_engine`")

from kvcluster import cpu_features  # noqa: E402
from kvcluster.actors.ray_start import start_ray  # noqa: E402
from kvcluster.integrations.vllm.store import engine_stores  # noqa: E402
from kvcluster.keys import KeySpace  # noqa: E402
from kvcluster.tokenizer import tokenizer_dir  # noqa: E402

from serve_support import ray_tmpdir  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BLOCK = 128  # vLLM's block size on CPU
PROMPT = [random.Random(7).randrange(3, 32000) for _ in range(4 * BLOCK + 88)]  # 4 full blocks and a tail
FINGERPRINT = "test-tiny-llama-dummy-f32"
KEYS = KeySpace(model=FINGERPRINT).chain_token_ids(PROMPT, BLOCK)
OPEN_ENGINES: list = []  # engines a test started (`engine`, or a module's own starter) and has not closed

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """kvcluster's tiny Llama config and the offline tokenizer, as a model directory vLLM can open."""
    d = tmp_path_factory.mktemp("tiny-llama")
    config = json.loads((REPO / "configs" / "models" / "kvcluster-tiny-llama.json").read_text())
    config.pop("_source")
    (d / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(tokenizer_dir() / name, d / name)
    return d


def engine(model_dir: Path, tiers: list[dict] | None = None, cluster: dict | None = None,
           engine_args: dict | None = None, across_tests: bool = False, **options):
    """An engine with random weights (vLLM's load_format="dummy"; seeded, so identical); with the kvcluster
    connector when `tiers` (on a kvcluster cluster with `cluster`; `options`: more connector settings;
    `engine_args`: more of vLLM's own). Shut down after the test that started it if still open there
    (`engines_closed`), unless `across_tests`: then a fixture that shares it closes it."""
    kw = {"dtype": "float32"} | dict(engine_args or {})
    if tiers is not None:
        extra = {"tiers": tiers, "model_fingerprint": FINGERPRINT} | ({"cluster": cluster} if cluster else {}) | options
        kw["kv_transfer_config"] = {
            "kv_connector": "KVClusterConnector",
            "kv_connector_module_path": "kvcluster.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    before = set(engine_stores())
    llm = vllm.LLM(model=str(model_dir), load_format="dummy", enforce_eager=True, seed=0,
                   enable_prefix_caching=True, max_model_len=2048, **kw)
    new = [s for e, s in engine_stores().items() if e not in before]
    assert len(new) == (0 if tiers is None else 1)
    if not across_tests:
        OPEN_ENGINES.append(llm)
    return llm, (new[0] if new else None)


def generate(llm, prompt: list[int] = PROMPT, salt: str = "") -> tuple[list[int], list[float], int]:
    """Greedy tokens, their log-probabilities and the prompt tokens the engine did not compute (for the tenant
    `salt`, "": a request that names none)."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    request = {"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt else {})
    out = llm.generate([request], params, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    return tokens, [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs)], out.num_cached_tokens


def close(llm) -> None:
    OPEN_ENGINES[:] = [e for e in OPEN_ENGINES if e is not llm]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(autouse=True)
def engines_closed():
    """Engines a test left running (it failed before closing them) are shut down after it: one failed test
    must not fail the next with an engine still holding the process's memory and distributed state."""
    yield
    while OPEN_ENGINES:
        close(OPEN_ENGINES[-1])


@pytest.fixture(scope="module")
def reference(model_dir):
    """vLLM alone: the prompt computed cold, then served from vLLM's own prefix cache (4 blocks)."""
    llm, _ = engine(model_dir)
    cold = generate(llm)
    warm = generate(llm)
    close(llm)
    assert cold[2] == 0 and warm[2] == 4 * BLOCK
    assert cold[0] == warm[0]
    return cold, warm


@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
def test_a_prefix_from_dram_and_nvme_gives_vllms_own_output(model_dir, reference, tmp_path, background) -> None:
    """Loads read on the loader thread (the request waits) or before the step's forward; saves written on the
    saver thread or within the step: the same output either way."""
    cold, warm = reference
    llm, shared = engine(model_dir, [{"kind": "dram", "capacity": "2MiB"},
                                     {"kind": "nvme", "capacity": "8MiB", "path": str(tmp_path / "nvme")}],
                         async_loads=background, async_saves=background)
    assert generate(llm) == cold  # nothing stored yet: computed, then its 4 full blocks saved
    assert (shared.saved_blocks, shared.loaded_blocks) == (4, 0)
    shared.wait_saved()
    manager = shared.store.tiered.manager
    assert sorted(manager.tier_of(k) for k in KEYS) == [0, 0, 1, 1]  # 2 MiB of dram holds 2 blocks of 1 MiB
    llm.reset_prefix_cache()  # vLLM forgets; the prefix must come from kvcluster
    assert generate(llm) == warm  # bit for bit what vLLM's own prefix cache gives
    assert (shared.loaded_blocks, shared.failed_blocks, shared.saved_blocks) == (4, 0, 4)
    close(llm)


def test_the_policy_counts_each_request_once_with_its_session_and_loaded_blocks(model_dir, reference,
                                                                                tmp_path) -> None:
    """The store gets a request's blocks in one call per step: the bytes it computed, the blocks it loaded as
    uses (no bytes), their pairs (the prompt's roles its `kv_transfer_params` name, HISTORY without them; cold
    first, then continuing a cached prefix) and the session they name."""
    from kvcluster.block_types import BlockType, TransitionType, pair_index
    from kvcluster.integrations.vllm.connector import SESSION_PARAM, SPANS_PARAM

    cold, warm = reference
    llm, shared = engine(model_dir, [{"kind": "dram", "capacity": "8MiB"}], policy="bayes", async_saves=False)
    calls, store = [], shared.store.store

    def recorded(keys, payloads, pairs=None, finish="", output_tokens=0, session="", continues=False):
        calls.append((list(keys), [p is None for p in payloads], list(pairs or ()), session)
                     + ((True,) if continues else ()))
        store(keys, payloads, pairs, finish, output_tokens, session, continues)

    shared.store.store = recorded
    answered, told = [], shared.store.answered

    def recorded_answer(session, finish, output_tokens):
        answered.append((session, finish, output_tokens, len(calls)))
        told(session, finish, output_tokens)

    shared.store.answered = recorded_answer
    roles = [[int(BlockType.SYSTEM), 300], [int(BlockType.HISTORY), len(PROMPT) - 300]]  # a 300-token system prompt
    first = vllm.SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, extra_args={
        "kv_transfer_params": {SESSION_PARAM: "tenant/alice", SPANS_PARAM: roles}})
    out = llm.generate([{"prompt_token_ids": PROMPT}], first, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == cold[0]
    cold_pairs = [pair_index(t, TransitionType.FIRST) for t in (BlockType.SYSTEM,) * 2 + (BlockType.HISTORY,) * 2]
    assert calls == [(KEYS, [False] * 4, cold_pairs, "tenant/alice")]  # block 2: 44 system tokens, 84 history
    assert shared.store.tiered.manager.sessions_known() == 1

    params = vllm.SamplingParams(temperature=0.0, max_tokens=6, logprobs=0,
                                 extra_args={"kv_transfer_params": {SESSION_PARAM: "tenant/alice"}})

    llm.reset_prefix_cache()  # the prefix comes from kvcluster: its blocks are uses of this request
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == warm[0] and out.num_cached_tokens == 4 * BLOCK
    append = pair_index(BlockType.HISTORY, TransitionType.APPEND)
    assert calls[1:] == [(KEYS, [True] * 4, [append] * 4, "tenant/alice")]
    assert shared.saved_blocks == 4 and shared.loaded_blocks == 4
    # the first request's answer (6 tokens, cut at max_tokens) reached the store with the next step, before
    # that step's save; a `length` finish names no class, and without the front's word a `stop` would not either
    assert answered == [("tenant/alice", "length", 6, 1)]

    # an answer that completes a block: a save of its own in a later step, which continues the request (two saves
    # of one request seconds apart are not two requests of its session): the policy gives it the first's class
    longer = vllm.SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, extra_args=params.extra_args)
    out = llm.generate([{"prompt_token_ids": PROMPT}], longer, use_tqdm=False)[0]
    fifth = KeySpace(model=FINGERPRINT).chain_token_ids(PROMPT + list(out.outputs[0].token_ids)[:40], BLOCK)[4]
    assert calls[2:] == [(KEYS, [True] * 4, [append] * 4, "tenant/alice"), ([fifth], [False], [append], "tenant/alice",
                                                                         True)]
    assert shared.store.tiered.manager.sessions_known() == 1
    policy = shared.store.tiered.hierarchy.policies[0]
    fifth_id = shared.store.tiered.manager._ids[bytes(fifth)]
    assert policy._gcls[policy._last[fifth_id]] == policy._gcls[policy._last[shared.store.tiered.manager._ids[
        bytes(KEYS[0])]]]
    close(llm)


@pytest.mark.parametrize("spans", [None, "system", [[0, 600]], [[0, 300], [1, 301]], [[9, 300], [1, 300]],
                                   [[0, 300], [1, -1], [1, 301]], [[0, 300.0], [1, 300]], [[0, 300, 1], [1, 300]]])
def test_roles_that_do_not_describe_the_prompt_leave_it_history(spans) -> None:
    from types import SimpleNamespace

    from kvcluster.block_types import BlockType
    from kvcluster.integrations.vllm.connector import SPANS_PARAM, prompt_types

    request = SimpleNamespace(kv_transfer_params={SPANS_PARAM: spans}, num_prompt_tokens=600)
    types = prompt_types(request, BLOCK)
    if spans == [[0, 600]]:  # all system prompt: the fifth block holds 88 of its tokens and 40 of the answer
        assert types == (BlockType.SYSTEM,) * 5
    else:  # not a list of [type, tokens] pairs adding up to the prompt: ignored
        assert types == (BlockType.HISTORY,) * 5


def test_of_two_requests_of_one_session_running_together_only_the_latest_tells_its_answer(model_dir, reference,
                                                                                          tmp_path) -> None:
    """The policy takes a session's answer for its latest request's: an earlier one still running when the
    latest saved (parallel agents under one user) must not re-class the latest's blocks with its own answer."""
    from kvcluster.integrations.vllm.connector import SESSION_PARAM

    llm, shared = engine(model_dir, [{"kind": "dram", "capacity": "16MiB"}], policy="bayes", async_saves=False)
    calls, answered, store, told = [], [], shared.store.store, shared.store.answered

    def recorded(keys, payloads, pairs=None, finish="", output_tokens=0, session="", continues=False):
        calls.append((len(keys), session, continues))
        store(keys, payloads, pairs, finish, output_tokens, session, continues)

    def recorded_answer(session, finish, output_tokens):
        answered.append((session, finish, output_tokens))
        told(session, finish, output_tokens)

    shared.store.store, shared.store.answered = recorded, recorded_answer
    other = [random.Random(8).randrange(3, 32000) for _ in range(2 * BLOCK + 5)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=6, logprobs=0,
                                 extra_args={"kv_transfer_params": {SESSION_PARAM: "tenant/bob"}})
    llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": other}], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": [5] * 20}], vllm.SamplingParams(max_tokens=2), use_tqdm=False)  # a step more
    assert sorted(calls) == [(2, "tenant/bob", False), (4, "tenant/bob", False)]
    assert answered == [("tenant/bob", "length", 6)]
    close(llm)


def test_a_finished_requests_answer_is_passed_on_as_the_front_vouches_for_it() -> None:
    """A `stop` may be a tool call that vLLM's OpenAI layer parses later: it ends the turn only when the request
    says so (kvcluster's front calls no tools); an aborted or failed request tells nothing."""
    from types import SimpleNamespace

    from vllm.v1.engine import FinishReason

    from kvcluster.integrations.vllm.connector import STOP_ENDS_TURN_PARAM, answer_of

    def finished(reason, params=None):
        return SimpleNamespace(get_finished_reason=lambda: reason, kv_transfer_params=params, num_output_tokens=42)

    assert answer_of(finished(FinishReason.STOP, {STOP_ENDS_TURN_PARAM: True})) == ("stop", 42)
    assert answer_of(finished(FinishReason.STOP)) == ("", 42)
    assert answer_of(finished(FinishReason.STOP, {STOP_ENDS_TURN_PARAM: "yes"})) == ("", 42)
    assert answer_of(finished(FinishReason.LENGTH)) == ("length", 42)
    assert answer_of(finished(FinishReason.ABORT)) is None
    assert answer_of(finished(FinishReason.ERROR)) is None
    assert answer_of(finished(None)) is None


def test_a_fresh_engine_loads_the_file_tier_and_a_corrupt_block_is_recomputed(model_dir, reference,
                                                                            tmp_path) -> None:
    cold, warm = reference
    tiers = [{"kind": "pfs", "capacity": "16MiB", "path": str(tmp_path / "pfs")}]
    llm, shared = engine(model_dir, tiers)
    assert generate(llm) == cold and shared.saved_blocks == 4
    close(llm)

    llm, shared = engine(model_dir, tiers)  # a fresh engine: only the block files remain
    assert sorted(shared.store.tiered.manager.tier_of(k) for k in KEYS) == [0, 0, 0, 0]
    assert generate(llm) == warm
    assert (shared.loaded_blocks, shared.saved_blocks) == (4, 0)

    pfs = shared.store.tiered.backends[0]
    path = pfs.path_for(KEYS[2])
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one payload byte of the third block
    path.write_bytes(bytes(data))
    llm.reset_prefix_cache()
    tokens, logprobs, cached = generate(llm)
    assert tokens == cold[0]  # blocks 2 and 3 were reported as load errors and recomputed
    assert logprobs == pytest.approx(cold[1], abs=1e-4)
    # blocks 0-1 loaded, 2-3 failed; the recompute stored block 2 again (block 3's file was intact)
    assert (shared.loaded_blocks, shared.failed_blocks, shared.saved_blocks) == (6, 2, 1)
    assert pfs.stats()["corrupt"] == 1

    shared.wait_saved()
    llm.reset_prefix_cache()  # the recomputed blocks were stored again: the whole prefix loads
    assert generate(llm) == warm
    assert (shared.loaded_blocks, shared.failed_blocks) == (10, 2)
    close(llm)


def test_a_clean_shutdown_keeps_the_memory_tiers_blocks_in_the_pfs_tier_for_the_next_engine(
        model_dir, reference, tmp_path) -> None:
    cold, warm = reference
    tiers = [{"kind": "dram", "capacity": "16MiB"}, {"kind": "pfs", "capacity": "16MiB", "path": str(tmp_path / "pfs")}]
    llm, shared = engine(model_dir, tiers)
    assert generate(llm) == cold and shared.saved_blocks == 4
    assert sorted(shared.store.tiered.manager.tier_of(k) for k in KEYS) == [0, 0, 0, 0]  # all in dram
    close(llm)  # the connector's shutdown copies them into the pfs directory

    llm, shared = engine(model_dir, tiers)  # a fresh engine: its dram is empty, the files remain
    assert sorted(shared.store.tiered.manager.tier_of(k) for k in KEYS) == [1, 1, 1, 1]
    assert generate(llm) == warm
    assert (shared.loaded_blocks, shared.saved_blocks) == (4, 0)
    close(llm)


@pytest.mark.parametrize("extra, message", [
    ({"tiers": []}, "tiers"),
    ({"tiers": [{"kind": "nvme", "capacity": "8MiB"}]}, "tier nvme: field path: the nvme tier needs a directory"),
    ({"tiers": [{"kind": "dram", "capacity": "8MiB", "path": "/tmp/x"}]}, "tier dram: field path"),
    ({"tiers": [{"kind": "dram", "capacity": "8MiB"}, {"kind": "dram", "capacity": "8MiB"}]},
     "field kind: each kind at most once, dram repeats"),
    ({"tiers": [{"kind": "cxl", "capacity": "8MiB"}]}, "field kind: the vLLM connector runs no cxl tier"),
    ({"tiers": [{"kind": "dram", "capacity": 512}]}, "tiers.0.capacity"),  # a bare number: bytes? MiB? refused
    ({"tiers": [{"kind": "dram", "capacity": "512 MB/s"}]}, "is not a size"),
    ({"tiers": [{"kind": "dram", "capacity_mib": 512}]}, "field capacity_mib: a tier is written {kind, capacity} "
                                                         "now, the capacity with its unit: capacity: 512MiB"),
    ({"tiers": [{"kind": "dram", "capacity": "8MiB"}], "policy": "nope"}, "unknown policy 'nope'"),
    ({"tiers": [{"kind": "dram", "capacity": "8MiB", "size": 1}]}, "size"),
    ({"tiers": [{"kind": "dram", "capacity": "8MiB"}], "cluster": {"node": ""}}, "cluster.node"),
    ({"tiers": [{"kind": "dram", "capacity": "8MiB"}], "cluster": {"node": "n0", "timeout_s": 0}}, "timeout_s"),
    ({"tiers": [{"kind": "dram", "capacity": "8MiB"}], "async_loads": "sometimes"}, "async_loads"),
])
def test_a_bad_extra_config_is_an_error_naming_the_field(extra, message) -> None:
    from kvcluster.errors import ConfigError
    from kvcluster.integrations.vllm.store import parse_config

    with pytest.raises(ConfigError, match="kv_connector_extra_config") as err:
        parse_config(extra)
    assert message in str(err.value)


def test_the_connector_s_tiers_are_the_one_tier_spec() -> None:
    """`tiers` take the schema of a cluster or tiers YAML (kvcluster.tiers.TierSpec): sizes with their unit, in
    any order, kept fastest first; what the engine is given back (model_dump) reads back the same."""
    from kvcluster.integrations.vllm.store import ConnectorConfig, parse_config
    from kvcluster.tiers import TierSpec

    config = parse_config({"tiers": [{"kind": "pfs", "capacity": "1.5GiB", "path": "/tmp/x"},
                                     {"kind": "dram", "capacity": "512MiB"}]})
    assert all(type(t) is TierSpec for t in config.tiers)
    assert [(t.kind, t.capacity) for t in config.tiers] == [("dram", 512 << 20), ("pfs", 1536 << 20)]
    dumped = config.model_dump(exclude_none=True)
    assert [t["capacity"] for t in dumped["tiers"]] == ["512MiB", "1536MiB"]
    assert ConnectorConfig.model_validate(dumped) == config


@pytest.fixture(scope="module")
def two_nodes():
    """A two-node Ray cluster (`ray.cluster_utils.Cluster`) running kvcluster's actors for this model's vLLM
    blocks: nodes n0 and n1, a dram tier actor on each, the index, the predictor and the control plane."""
    import ray
    from ray.cluster_utils import Cluster

    from kvcluster.actors.cluster import down, up
    from kvcluster.actors.index_actor import NAMESPACE
    from kvcluster.cluster_config import ClusterConfig

    with ray_tmpdir("kvcv") as tmp:
        args = {"object_store_memory": 128 << 20}
        c = start_ray(lambda: Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"n0": 1},
                                                         "include_dashboard": False, **args}))
        start_ray(lambda: c.add_node(num_cpus=1, resources={"n1": 1}, **args))
        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
        c.wait_for_nodes()
        dram = [{"kind": "dram", "capacity": "10MiB"}]  # 10 blocks of 1 MiB
        cfg = ClusterConfig.model_validate({
            "model": "kvcluster-tiny-llama", "block_tokens": BLOCK, "dtype": "fp32", "policy": "lru",
            "checkpoint_dir": os.path.join(tmp, "predictor"),
            "nodes": [{"name": "n0", "ray_resource": "n0", "tiers": dram},
                      {"name": "n1", "ray_resource": "n1", "tiers": dram}]})
        assert cfg.block_bytes() == 1 << 20  # = vLLM's block of every layer (page bytes x layers)
        up(cfg)
        try:
            yield cfg
        finally:
            down(cfg)
            ray.shutdown()
            c.shutdown()


class LendingEngine:
    """A vLLM engine with the kvcluster connector in a Ray actor of its own (one engine per process: vLLM keeps
    its connector in a process global), on the node it joins the cluster as."""

    def __init__(self, model_dir: str, node: str) -> None:
        extra = {"tiers": [{"kind": "dram", "capacity": "8MiB"}], "model_fingerprint": FINGERPRINT,
                 "cluster": {"node": node}}
        self.llm = vllm.LLM(model=model_dir, load_format="dummy", enforce_eager=True, dtype="float32", seed=0,
                            enable_prefix_caching=True, max_model_len=2048, kv_transfer_config={
                                "kv_connector": "KVClusterConnector",
                                "kv_connector_module_path": "kvcluster.integrations.vllm.connector",
                                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                "kv_connector_extra_config": extra})
        (self.shared,) = engine_stores().values()

    def generate(self, prompt: list[int]) -> tuple[list[int], list[float], int]:
        return generate(self.llm, prompt)

    def lent_blocks(self, keys: list) -> list[int | None]:
        return [self.shared.lending.blocks.block_of(k) for k in keys]

    def flip_a_bit(self, key) -> None:
        """One bit of the block's pages rots (its second layer's page, byte 5)."""
        self.shared.lending.paged.block_pages(self.shared.lending.blocks.block_of(key))[1][5] ^= 0x01

    def close(self) -> None:
        close(self.llm)


def test_on_a_cluster_an_engines_paged_kv_is_its_nodes_hbm_tier_read_straight_from_its_pages(model_dir,
                                                                                             two_nodes) -> None:
    """An engine on n0 lends its paged KV: the index finds each prompt's 4 blocks at (n0, hbm), and an engine
    on n1 reads the first prompt's over NIXL from n0's pages into its own (chosen over n0's dram copy: hbm is
    faster), giving the output of n0's own prefix cache bit for bit. That use moves the blocks to n1 (the
    control plane's policy places what a node's requests use), where the next engine there would read them.
    A bit flipped in n0's pages of the second prompt fails its checksum at n1: that block is read from its
    next copy, n0's dram, and the output is the same. Once the n0 engine shuts down the index forgets its
    pages, and lists the other copies only."""
    import ray

    from kvcluster.actors.index_client import IndexClient

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 32000) for _ in range(4 * BLOCK + 40)] for _ in range(2)]
    chains = [KeySpace(model=FINGERPRINT).chain_token_ids(prompt, BLOCK) for prompt in prompts]
    env = {k: os.environ[k] for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS",
                                      "VLLM_TARGET_DEVICE") if k in os.environ}
    here = str(Path(__file__).resolve().parent)  # the actor's class is this module's: its worker imports it
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    lender = ray.remote(LendingEngine).options(num_cpus=0, resources={"n0": 0.1}, runtime_env={"env_vars": env}) \
        .remote(str(model_dir), "n0")
    warm = []
    for prompt, keys in zip(prompts, chains):
        cold = ray.get(lender.generate.remote(prompt), timeout=240)
        warm.append(ray.get(lender.generate.remote(prompt)))  # from n0's own prefix cache: the reference
        assert cold[2] == 0 and warm[-1][2] == 4 * BLOCK
        assert None not in ray.get(lender.lent_blocks.remote(keys))
    index = IndexClient.connect()

    def listed(keys, where) -> bool:
        match = index.longest_prefix(keys)
        return match.length == 4 and all(any(where(loc) for loc in locs) for locs in match.locations)

    deadline = time.monotonic() + 300
    while not all(listed(keys, lambda loc: tuple(loc) == ("n0", "hbm")) for keys in chains):
        assert time.monotonic() < deadline, "the index never learned of n0's lent pages"  # reported per step
        time.sleep(0.2)

    local = [{"kind": "dram", "capacity": "8MiB"}]
    llm, shared = engine(model_dir, local, {"node": "n1"})
    assert generate(llm, prompts[0]) == warm[0]
    assert (shared.loaded_blocks, shared.failed_blocks) == (4, 0)
    assert (shared.store.counters["lent_pages"], shared.store.counters["nixl_in_place"]) == (4, 4)
    close(llm)
    deadline = time.monotonic() + 300
    while not listed(chains[0], lambda loc: loc[0] == "n1" and loc[1] != "hbm"):
        assert time.monotonic() < deadline, "the blocks n1 used were not moved to n1's tiers"
        time.sleep(0.2)

    ray.get(lender.flip_a_bit.remote(chains[1][2]))  # block 2 of the second prompt rots in n0's pages
    llm, shared = engine(model_dir, local, {"node": "n1"})
    assert generate(llm, prompts[1]) == warm[1]  # block 2 from n0's dram instead, into the pages the bad copy filled
    counters = shared.store.counters
    assert (shared.loaded_blocks, shared.failed_blocks) == (4, 0)
    assert (counters["lent_pages"], counters["second_copies"], counters["dram"]) == (3, 1, 1)
    close(llm)

    ray.get(lender.close.remote())  # retires its pages: the index forgets them before shutdown returns
    ray.kill(lender)
    match = index.longest_prefix(chains[1])  # the copies n1 moved to its tiers stay
    assert match.length == 4 and all(("n0", "hbm") not in locs for locs in match.locations)


def test_on_a_cluster_a_prefix_comes_from_another_nodes_dram_and_a_dead_tier_is_recomputed(model_dir, reference,
                                                                                        two_nodes) -> None:
    """An engine on n0 saves two prompts' blocks: the control plane places them in n0's dram tier actor. A fresh
    engine on n1 is told by the cluster's index that all 4 of the first are held and reads them from n0's dram
    over NIXL, giving vLLM's own output bit for bit, the blocks written over NIXL straight into its paged KV;
    its use copies them to n1's dram; the same prompt for another tenant (`cache_salt`) loads none of them. A
    block of the second prompt that rots in n0's memory fails its checksum in the pages it landed in: that block
    and the ones after it are recomputed. With n1's tier actor killed, an engine on n0 is promised the first
    prompt's blocks by the index (n0's own copies dropped behind its back), cannot load them, and recomputes: the
    same tokens."""
    import ray

    from kvcluster.actors.index_actor import NAMESPACE
    from kvcluster.actors.index_client import IndexClient
    from kvcluster.actors.tier_actor import actor_name

    cold, warm = reference
    other = [random.Random(13).randrange(3, 32000) for _ in range(4 * BLOCK + 20)]
    other_keys = KeySpace(model=FINGERPRINT).chain_token_ids(other, BLOCK)
    local = [{"kind": "dram", "capacity": "8MiB"}]
    llm, shared = engine(model_dir, local, {"node": "n0"})
    assert generate(llm) == cold
    other_cold = generate(llm, other)  # computed: the reference for the second prompt
    assert other_cold[2] == 0 and shared.saved_blocks == 8
    close(llm)
    index = IndexClient.connect()

    def where(keys) -> set:
        return {tuple(loc) for locs in index.longest_prefix(keys).locations for loc in locs}

    deadline = time.monotonic() + 300
    while index.longest_prefix(KEYS).length < 4 or index.longest_prefix(other_keys).length < 4:
        assert time.monotonic() < deadline, "the cluster never indexed the saved blocks"  # placed fire-and-forget
        time.sleep(0.2)
    assert where(KEYS) == where(other_keys) == {("n0", "dram")}

    llm, shared = engine(model_dir, local, {"node": "n1"})  # nothing in its own tiers
    assert generate(llm) == warm  # the same KV bytes as vLLM's own prefix cache: same log-probabilities
    assert (shared.loaded_blocks, shared.failed_blocks) == (4, 0)
    assert shared.store.counters["nixl_blocks"] == 4  # straight from n0's slab ...
    assert shared.store.counters["nixl_in_place"] == 4  # ... into the engine's paged KV (registered with NIXL)
    llm.reset_prefix_cache()  # from here only kvcluster could answer a prefix
    assert generate(llm, salt="tenant-b")[2] == 0  # another tenant: the index lists none of its keys
    assert (shared.loaded_blocks, shared.failed_blocks) == (4, 0)
    llm.reset_prefix_cache()
    assert generate(llm) == warm  # now from its own dram: the blocks were promoted there as they landed
    assert (shared.loaded_blocks, shared.store.counters["nixl_blocks"], shared.store.counters["hbm"]) == (8, 4, 4)
    close(llm)
    deadline = time.monotonic() + 300
    while ("n1", "dram") not in where(KEYS):  # the request's use copied them to the node serving it
        assert time.monotonic() < deadline, f"n1's use did not copy its blocks there: {where(KEYS)}"
        time.sleep(0.2)
    assert where(KEYS) == {("n0", "dram"), ("n1", "dram")}  # n0's copies stay until its own policy drops them

    def flip_a_bit(tier_actor, key: bytes) -> None:  # runs inside the tier actor (nested: pickled by value)
        tier_actor.backend.pool[tier_actor.backend.table.get(key).slot, 5] ^= 0x01

    dram_n0 = ray.get_actor(actor_name("n0", "dram"), namespace=NAMESPACE)
    ray.get(dram_n0.__ray_call__.remote(flip_a_bit, other_keys[2]))  # block 2 rots in n0's memory
    llm, shared = engine(model_dir, local, {"node": "n1"})
    tokens, logprobs, _ = generate(llm, other)
    assert tokens == other_cold[0] and logprobs == pytest.approx(other_cold[1], abs=1e-4)
    assert (shared.loaded_blocks, shared.failed_blocks) == (2, 2)  # its bad pages and those after: recomputed
    assert shared.store.counters["nixl_in_place"] == 2
    close(llm)

    with pytest.raises(Exception, match="cluster.node: no tier actors of node 'n7' are running"):
        engine(model_dir, local, {"node": "n7"})  # a node the cluster does not have: refused by name, at startup

    ray.kill(ray.get_actor(actor_name("n1", "dram"), namespace=NAMESPACE), no_restart=True)
    ray.get(dram_n0.__ray_call__.remote(lambda tier_actor, keys: tier_actor.backend.delete(keys), list(KEYS)))
    llm, shared = engine(model_dir, local, {"node": "n0"})
    tokens, logprobs, _ = generate(llm)
    assert tokens == cold[0] and logprobs == pytest.approx(cold[1], abs=1e-4)
    assert (shared.loaded_blocks, shared.failed_blocks) == (0, 4)  # promised by the index, recomputed by vLLM
    close(llm)


@pytest.mark.parametrize("backend,dtype,tolerance", [
    ("CPU_MLA", "fp32", 1e-4),  # vLLM's reference MLA kernels, on any CPU
    pytest.param("AMX_MLA", "bf16", 2e-2, marks=pytest.mark.skipif(not cpu_features.has_amx(),
                                                                   reason=cpu_features.NO_AMX)),
])
def test_an_mla_model_stores_its_latent_and_a_prefix_from_kvcluster_gives_the_same_tokens(
        tmp_path, backend: str, dtype: str, tolerance: float) -> None:
    """DeepSeek-V3's attention (MLA) under vLLM: its paged KV is the compressed latent (kv_lora_rank + the roped
    key part, one "head"), and that is what kvcluster's blocks hold, byte for byte the size kvcluster's own layout
    gives the latent. With vLLM's own prefix cache emptied (its reference kernels keep it off for MLA anyway), a
    second request's prefix can only come from kvcluster: every full block of it does, and the greedy tokens equal
    the cold ones. On a CPU with AMX, vLLM picks its AMX kernels for 16-bit weights: the same, in bf16."""
    from kvcluster.model_spec import load_model_spec
    from kvcluster.storage.layout import layout_for

    config = json.loads((REPO / "configs" / "models" / "kvcluster-tiny-mla.json").read_text())
    config.pop("_source")
    config.update(kv_lora_rank=512, qk_rope_head_dim=64)  # the latent width vLLM's MLA kernels take (576)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(tokenizer_dir() / name, tmp_path / name)
    # the backend asked for by name: the AMX kernels take 16-bit weights only, and vLLM picks them where it can
    llm, shared = engine(tmp_path, [{"kind": "dram", "capacity": "16MiB"}],
                         engine_args={"attention_config": {"backend": backend},
                                      "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype]})
    block_tokens = llm.llm_engine.vllm_config.cache_config.block_size
    latent = layout_for(load_model_spec(str(tmp_path / "config.json")), block_tokens, dtype)
    assert latent.kind == "latent" and shared.local.tiered.block_bytes == latent.nbytes()
    # layers x tokens x latent x element: no K, no V
    assert latent.nbytes() == 3 * block_tokens * (512 + 64) * {"fp32": 4, "bf16": 2}[dtype]
    cold = generate(llm)
    shared.wait_saved()
    llm.reset_prefix_cache()
    warm = generate(llm)
    blocks = (len(PROMPT) - 1) // block_tokens
    assert cold[2] == 0 and warm[2] == blocks * block_tokens  # all from kvcluster
    assert (shared.saved_blocks, shared.loaded_blocks, shared.failed_blocks) == (blocks, blocks, 0)
    assert warm[0] == cold[0] and warm[1] == pytest.approx(cold[1], abs=tolerance)
    close(llm)
