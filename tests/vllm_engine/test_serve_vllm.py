"""The vLLM Serve app end to end (configs/serve.yaml's app): the OpenAI API over vLLM replicas with
kvcluster's connector, asked with the official `openai` client.

Two replicas on one node, started in-process with `serve.run` on a local two-CPU Ray, given one connector config
(a small dram tier over an nvme path); the same long prompt twice must be computed the first time (cached_tokens
0) and served from the engine's prefix cache the second (every full block but the one holding the last prompt
token: the engine must compute that token for its logits), with the same greedy text; a bad request is a 400
naming the field; each replica claims an nvme slab of its own and reads its blocks back from it intact. The
routing rule is checked without Ray.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["RAY_AUTH_MODE"] = "disabled"

pytest.importorskip("vllm", reason="vLLM is not installed here; run `bash scripts/setup.sh`")
ray = pytest.importorskip("ray", reason="Ray is not installed in this venv; rerun `bash scripts/setup_vllm.sh`")
openai = pytest.importorskip("openai")

from ray import serve  # noqa: E402
from serve_support import BLOCK, MODEL, local_serve, long_prompt  # noqa: E402


LONG_PROMPT = long_prompt(5)

pytestmark = pytest.mark.timeout(300)


REPLICAS = 2
ENGINE_BLOCKS = 10  # vLLM's own paged KV per replica: one request of 1,024 tokens, so a long prompt evicts another


@pytest.fixture(scope="module")
def nvme_path(tmp_path_factory) -> str:
    """The one nvme path both replicas are given."""
    return str(tmp_path_factory.mktemp("nvme"))


@pytest.fixture(scope="module")
def client(nvme_path):
    """The app on a local Ray, two replicas (one CPU each; the front takes none) whose connector keeps 2 blocks
    (1 MiB each) in dram and demotes the rest into nvme; Serve and Ray shut down after."""
    from kvcluster.serve_apps.vllm_app import build_app

    tiers = [{"kind": "dram", "capacity": "2MiB"}, {"kind": "nvme", "capacity": "64MiB", "path": nvme_path}]
    with local_serve("kvv-") as (_, port):
        serve.run(build_app({"model": MODEL, "num_replicas": REPLICAS, "replica_cpus": 1,
                             "max_model_len": 1024, "kv_cache_blocks": ENGINE_BLOCKS,
                             "connector": {"tiers": tiers}, "api": {"max_tokens_limit": 64}}),
                  name="vllm", route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)


def replica_infos() -> list[dict]:
    """`info()` of every replica: a handle's call goes to any one, so asked until each has answered."""
    handle = serve.get_deployment_handle("VLLMReplica", app_name="vllm")
    seen: dict[int, dict] = {}
    for _ in range(64):
        info = handle.info.remote().result()
        seen[info["pid"]] = info
        if len(seen) == REPLICAS:
            return list(seen.values())
    raise AssertionError(f"only {len(seen)} of {REPLICAS} replicas answered info() in 64 calls")


def summed(infos: list[dict], counter: str) -> int:
    return sum(info["connector"][counter] for info in infos)


def nvme_tier(info: dict) -> dict:
    (nvme,) = [t for t in info["connector"]["tiers"] if t["name"] == "nvme"]
    return nvme


def test_a_repeated_prompt_is_served_from_the_cache_with_the_same_greedy_text(client) -> None:
    first = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    second = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens == second.usage.prompt_tokens and prompt_tokens > 2 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // BLOCK * BLOCK
    assert first.choices[0].text == second.choices[0].text
    assert first.usage.completion_tokens == second.usage.completion_tokens == 8

    infos = replica_infos()
    assert all(info["block_size"] == BLOCK for info in infos)
    # the connector stored the prompt's full blocks; vLLM's own prefix cache served the repeat, so none loaded
    assert summed(infos, "saved_blocks") >= prompt_tokens // BLOCK
    assert summed(infos, "loaded_blocks") == 0


def test_chat_reports_cached_tokens_too_and_the_user_is_the_session_the_policy_learns(client) -> None:
    messages = [{"role": "system", "content": LONG_PROMPT}, {"role": "user", "content": "and then?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, user="alice")
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, user="alice")
    assert second.usage.prompt_tokens_details.cached_tokens == (second.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message.content == second.choices[0].message.content
    infos = replica_infos()
    assert summed(infos, "sessions") == 1  # the first test's requests named no user
    assert summed(infos, "answers_told") >= 1  # alice's first answer, with the step of her second request


def test_a_bad_request_is_a_400_naming_the_field(client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=0)
    assert err.value.status_code == 400
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=65)
    assert "at most 64" in err.value.body["message"]


def test_replicas_on_one_node_given_one_nvme_path_each_read_their_own_blocks_back_from_a_slab_of_their_own(
        client, nvme_path) -> None:
    """Issue 55: both replicas' connectors were given one nvme path. Four users each store a prompt and push it out
    of vLLM's paged KV and out of dram (a long filler of the same user, so the same replica); new sessions go to
    the least loaded replica, so both replicas store. Only then is each prompt asked again: its blocks load from
    its replica's nvme slab, r0 or r1, intact. With one shared slab, the replica that wrote second overwrote the
    first one's slots, whose reads then failed their checksums (and the prompt was recomputed)."""
    users = [f"u{i}" for i in range(4)]
    prompts = {user: long_prompt(100 + i, words=400) for i, user in enumerate(users)}
    for i, user in enumerate(users):
        for text in (prompts[user], long_prompt(200 + i, words=900)):
            client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0, user=user)
    for user in users:
        again = client.completions.create(model=MODEL, prompt=prompts[user], max_tokens=1, temperature=0, user=user)
        assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // BLOCK * BLOCK
    infos = replica_infos()
    slabs = sorted(nvme_tier(info)["slab"] for info in infos)
    assert slabs == [f"{nvme_path}/r{i}/kvcluster-nvme.slab" for i in range(REPLICAS)]
    for info in infos:
        assert all(tier["corrupt"] == 0 for tier in info["connector"]["tiers"]), info["connector"]["tiers"]
        assert nvme_tier(info)["gets"] > 0 and info["connector"]["failed_blocks"] == 0, info["connector"]


class _FakeEngine:
    """Each step gives every running request one output; a request is finished after `steps` of them."""

    def __init__(self, steps: int = 2, fail_on_step: int | None = None) -> None:
        self.steps, self.fail_on_step, self.stepped = steps, fail_on_step, 0
        self.running: dict[str, int] = {}
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params) -> None:
        if not prompt["prompt_token_ids"]:
            raise ValueError("empty prompt")
        self.running[request_id] = 0

    def abort_request(self, ids) -> None:
        self.aborted += ids
        for rid in ids:
            self.running.pop(rid, None)

    def step(self) -> list:
        time.sleep(0.001)  # a forward takes time: a caller's abort arrives while its request runs
        self.stepped += 1
        if self.stepped == self.fail_on_step:
            raise RuntimeError("kernel failed")
        out = []
        for rid in list(self.running):
            self.running[rid] += 1
            done = self.running[rid] == self.steps
            out.append(SimpleNamespace(request_id=rid, finished=done, n=self.running[rid]))
            if done:
                del self.running[rid]
        return out


def test_the_engine_loop_serves_refuses_aborts_and_fails_every_request_when_a_step_raises() -> None:
    import asyncio

    from kvcluster.serve_apps.vllm_engine_loop import EngineDead, EngineLoop

    async def drain(queue) -> list:
        items = []
        while True:
            item = await asyncio.wait_for(queue.get(), 10)
            items.append(item)
            if isinstance(item, Exception) or item.finished:
                return items

    async def scenario() -> None:
        engine = _FakeEngine(steps=3)
        loop = EngineLoop(engine)
        a, b = loop.submit("a", {"prompt_token_ids": [1]}, None), loop.submit("b", {"prompt_token_ids": [2]}, None)
        bad = loop.submit("bad", {"prompt_token_ids": []}, None)
        got_a, got_b, got_bad = await asyncio.gather(drain(a), drain(b), drain(bad))
        assert [o.n for o in got_a] == [o.n for o in got_b] == [1, 2, 3]
        assert engine.stepped <= 6 and engine.running == {}
        assert len(got_bad) == 1 and isinstance(got_bad[0], ValueError)
        loop.close()

        engine = _FakeEngine(steps=10 ** 6)
        loop = EngineLoop(engine)
        c = loop.submit("c", {"prompt_token_ids": [3]}, None)
        await asyncio.wait_for(c.get(), 10)
        loop.abort("c")
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["c"]
        loop.close()

        engine = _FakeEngine(steps=5, fail_on_step=2)
        loop = EngineLoop(engine)
        x, y = loop.submit("x", {"prompt_token_ids": [1]}, None), loop.submit("y", {"prompt_token_ids": [2]}, None)
        got_x, got_y = await asyncio.gather(drain(x), drain(y))
        assert got_x[0].n == 1 and isinstance(got_x[-1], EngineDead) and isinstance(got_y[-1], EngineDead)
        assert isinstance(loop.error, RuntimeError)
        with pytest.raises(EngineDead):
            loop.submit("z", {"prompt_token_ids": [1]}, None)

    asyncio.run(scenario())
