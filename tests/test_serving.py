"""The OpenAI endpoint on Ray Serve, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import json
import httpx
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from kvcluster.serving.chat import ChatMessage, render_chat  # noqa: E402
from kvcluster.serving.models import load_model  # noqa: E402
from kvcluster.serving.runner import ModelRunner  # noqa: E402
from kvcluster.serving.sampling import SamplingParams  # noqa: E402

from serving_support import API_KEY, DOC, METRICS, MODEL, SECURE_MODEL, expected_cached  # noqa: E402


def test_models_and_health(client, endpoint):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{endpoint}/health").json()["status"] == "ok"


def test_replicas_tell_the_ingress_their_model_fingerprint(endpoint):
    """The ingress builds routing keys from the replicas' fingerprint (one info call), so a replica whose random
    weights were drawn on another device than the ingress's still gets prefix-affine traffic."""
    from ray import serve

    from kvcluster.serving.models import model_fingerprint

    info = serve.get_deployment_handle("KVReplica", app_name="default").info.remote().result(timeout_s=60)
    assert info["fingerprint"] == model_fingerprint(MODEL, "fp32", 0, "cpu") and info["node"] == "n0"
    r = httpx.post(f"{endpoint}/v1/completions", json={"model": MODEL, "prompt": DOC, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200 and r.headers["x-kvcluster-node"] == "n0"


def test_completion_with_cache_hit_equals_cold_output(client, reference):
    prompt = "Summary of the design: " + DOC
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ids = reference.loaded.tokenizer.encode(prompt)
    expected = reference.complete(ids, SamplingParams(max_tokens=12, temperature=0))
    assert first.choices[0].text == second.choices[0].text == expected.text
    assert first.usage.prompt_tokens == len(ids) and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16  # truthful: full blocks
    assert second.usage.completion_tokens == expected.completion_tokens


def test_streaming_completion_matches_and_ends_with_done(client, endpoint, reference):
    prompt = "Streaming check: " + DOC[:200]
    ids = reference.loaded.tokenizer.encode(prompt)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected_cached(ids, [ids])  # the same prompt
    raw = httpx.post(f"{endpoint}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                          "temperature": 0, "stream": True}, timeout=120)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.splitlines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_chat_multi_turn_reuses_history(client, reference):
    history = [{"role": "system", "content": "You are terse. " + DOC[:300]}, {"role": "user", "content": "Why?"}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    answer = first.choices[0].message.content
    assert first.choices[0].message.role == "assistant"
    ids, _ = render_chat(reference.loaded.tokenizer, [ChatMessage(**m) for m in history])
    cold = reference.complete(ids, SamplingParams(max_tokens=8, temperature=0))
    assert answer == cold.text
    turn = history + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, temperature=0)
    ids2, _ = render_chat(reference.loaded.tokenizer, [ChatMessage(**m) for m in turn])
    # the first turn stored its prompt and answer (the answer re-rendered here may tokenize differently)
    assert second.usage.prompt_tokens_details.cached_tokens == expected_cached(ids2, [ids + cold.output_ids[:-1]])
    assert second.choices[0].message.content == reference.complete(ids2, SamplingParams(max_tokens=8,
                                                                                        temperature=0)).text
    stream = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == second.choices[0].message.content


def test_cache_salt_separates_tenants(client, reference):
    prompt = "Tenant isolation: " + DOC[:400]
    ids = reference.loaded.tokenizer.encode(prompt)
    extra = {"cache_salt": "tenant-x"}
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
    other = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"cache_salt": "tenant-y"})
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens == expected_cached(ids, [ids])  # its own first request


def test_the_api_user_is_the_session_whose_pace_the_policy_learns(client):
    """A request's `user` (else its x-user-id or x-session-id header) reaches the control plane's policy as its
    session; requests without one add none."""
    import time

    from kvcluster.actors.index_actor import NAMESPACE
    from kvcluster.actors.node_control_actor import control_name

    control = ray.get_actor(control_name("n0"), namespace=NAMESPACE)

    def sessions() -> int:
        return ray.get(control.stats.remote(), timeout=60)["sessions"]

    def settled(expected: int) -> int:  # commits are fire-and-forget: wait for them to land
        deadline, seen = time.monotonic() + 300, sessions()
        while seen != expected and time.monotonic() < deadline:
            time.sleep(0.2)
            seen = sessions()
        return seen

    before = sessions()
    messages = [{"role": "user", "content": "Pace: " + DOC[:200]}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, user="alice")
    assert settled(before + 1) == before + 1
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, user="alice")
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    client.completions.create(model=MODEL, prompt="Pace: " + DOC[:100], max_tokens=2, temperature=0, user="bob")
    assert settled(before + 2) == before + 2
    # without a `user`, the session headers load generators send name it: bob again, then carol
    client.completions.create(model=MODEL, prompt="Pace: " + DOC[:100], max_tokens=2, temperature=0,
                              extra_headers={"x-user-id": "bob"})
    client.completions.create(model=MODEL, prompt="Pace: " + DOC[:100], max_tokens=2, temperature=0,
                              extra_headers={"x-session-id": "carol"})
    assert settled(before + 3) == before + 3
    time.sleep(1)
    assert sessions() == before + 3
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Pace", max_tokens=2, extra_headers={"x-session-id": "x" * 257})
    assert err.value.body["param"] == "x-session-id"


def test_sampled_completion_is_repeatable_with_seed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.9, top_p=0.95, seed=11)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


BAD_REQUESTS = [  # status codes as OpenAI's and vLLM's servers give them: malformed 400, unknown model 404
    ("completions", b"{not json", 400),
    ("completions", {"model": "", "prompt": "x"}, 400),  # empty model name
    ("completions", {"model": MODEL}, 400),  # missing prompt
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400),
    ("completions", {"model": MODEL, "prompt": "word " * 5000, "max_tokens": 10}, 400),  # over the window
    ("completions", {"model": MODEL, "prompt": [5, 70000]}, 400),  # token id outside the vocabulary
    ("completions", {"model": MODEL, "prompt": ""}, 400),
    ("completions", {"model": "gpt-4o", "prompt": "x"}, 404),
    ("completions", {"model": MODEL, "prompt": "x", "n": 200}, 400),
    ("completions", {"model": MODEL, "prompt": 17}, 400),
    ("completions", [1, 2, 3], 400),
    ("chat/completions", {"model": MODEL, "messages": []}, 400),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("chat/completions", {"model": MODEL, "messages": "hello"}, 400),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 7}, 400),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                        "content": [{"type": "image_url"}]}]}, 400),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 5000}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(endpoint, path, body, status):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{endpoint}/v1/{path}", headers={"content-type": "application/json"}, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"


def test_bad_request_through_the_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.completions.create(model=MODEL, prompt="word " * 5000, max_tokens=5)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=5)


def test_api_keys_and_sliding_window_model(endpoint):
    good = openai.OpenAI(base_url=f"{endpoint}/secure/v1", api_key=API_KEY, max_retries=0, timeout=120)
    bad = openai.OpenAI(base_url=f"{endpoint}/secure/v1", api_key="sk-wrong", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    prompt = "Sliding window: " + DOC  # longer than the 64-token window
    a = good.completions.create(model=SECURE_MODEL, prompt=prompt, max_tokens=10, temperature=0)
    b = good.completions.create(model=SECURE_MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    local = ModelRunner(load_model(SECURE_MODEL))
    ids = local.loaded.tokenizer.encode(prompt)
    assert len(ids) > 64  # past the window: every block is kept, sliding layers restore only what they still see
    assert b.usage.prompt_tokens_details.cached_tokens == expected_cached(ids, [ids])
    assert a.choices[0].text == local.complete(ids, SamplingParams(max_tokens=10, temperature=0)).text
    r = httpx.get(f"{endpoint}/secure/v1/models")
    assert r.status_code == 401 and json.loads(r.text)["error"]["code"] == "invalid_api_key"


# The gauges (tier bytes, posterior means, gap to Belady) are re-recorded every export interval by
# kvcluster.actors.metrics.KeptGauge: Ray 2.60 forgets a gauge series not recorded during an interval.
EXPECTED_METRICS = ["ray_kvcluster_tier_bytes", "ray_kvcluster_tier_lookups", "ray_kvcluster_bytes_moved",
                    "ray_kvcluster_evictions", "ray_kvcluster_ttft_seconds", "ray_kvcluster_cached_tokens",
                    "ray_kvcluster_requests", "ray_kvcluster_predictor_posterior_mean", "ray_kvcluster_belady_gap",
                    "ray_kvcluster_prefetch_total", "ray_kvcluster_control_tracked"]


def test_metrics_endpoint_shows_the_cache_after_traffic(client):
    """Real traffic, then Ray's metrics export: every kvcluster metric the traffic touches is there."""
    import time

    prompts = [f"metrics {i}: " + DOC[: 200 + 40 * (i % 6)] for i in range(21)]
    for prompt in prompts + prompts[:2]:  # distinct prompts overflow the 48-block hbm tier (evictions), so the
        # first ones come back from dram (tier hits); 20+ requests give a gap-to-Belady estimate
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    # blocks put into the node's dram as promoted ahead of use (prefetch=True; no live component issues such
    # puts at present, so this test does), then one read (a prefetch hit) and two deleted unread (wasted)
    import numpy as np

    from kvcluster.actors.index_actor import NAMESPACE
    from kvcluster.keys import KeySpace

    dram = ray.get_actor("kvcluster/n0/dram", namespace=NAMESPACE)
    promoted = [bytes(k) for k in KeySpace(model="metrics-prefetch").chain_hash_ids(list(range(3)))]
    assert ray.get(dram.put_many.remote(promoted, [np.zeros(4096, np.uint8)] * 3, None, True)) == [True] * 3
    ray.get(dram.get_many.remote(promoted[:1]))
    ray.get(dram.delete.remote(promoted[1:]))
    details = ['tier="dram"', 'outcome="hit"', 'how="store"', 'status="200"', 'outcome="wasted"',
               'unit="block"', 'unit="head_shard"']

    def scrape_until_complete(timeout_s: float) -> tuple[list, str]:
        """Ray's /metrics can answer with part of the series (ray-project/ray#63131): poll for a whole view."""
        deadline, text, missing = time.monotonic() + timeout_s, "", EXPECTED_METRICS + details
        while missing and time.monotonic() < deadline:
            time.sleep(1)
            text = httpx.get(f"http://127.0.0.1:{METRICS['port']}/metrics", timeout=30).text
            missing = [m for m in EXPECTED_METRICS + details if m not in text]
        return missing, text

    missing, text = scrape_until_complete(60)
    present = sorted({line.split("{")[0] for line in text.splitlines() if line.startswith("ray_kvcluster")})
    assert not missing, f"missing {missing}; present: {present}"
    time.sleep(5)  # five export intervals with no traffic: gauges set once (posterior means at start) remain
    missing, _ = scrape_until_complete(15)
    assert not missing, f"gone after 5 s idle: {missing}"


def test_a_tool_result_marked_reusable_anywhere_is_served_at_another_offset(endpoint, reference):
    """kv_reuse: anywhere on a message: its blocks come back re-rotated after a different prefix."""
    tool = {"role": "tool", "content": "Search result: " + DOC[:500], "kv_reuse": "anywhere"}
    first = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Find it."}, tool]
    second = [{"role": "system", "content": "A different, somewhat longer system prompt than before."},
              {"role": "user", "content": "Look this up for me please."}, tool]
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    a = httpx.post(f"{endpoint}/v1/chat/completions", json={**body, "messages": first}, timeout=120).json()
    b = httpx.post(f"{endpoint}/v1/chat/completions", json={**body, "messages": second}, timeout=120).json()
    assert a["usage"]["prompt_tokens_details"].get("position_independent_tokens", 0) == 0
    details = b["usage"]["prompt_tokens_details"]
    ids, spans = render_chat(reference.loaded.tokenizer, [ChatMessage(**m) for m in second])
    ids_a, _ = render_chat(reference.loaded.tokenizer, [ChatMessage(**m) for m in first])
    assert details["cached_tokens"] == expected_cached(ids, [ids_a]) == 0  # the system prompts differ at once
    # the tool result ends both prompts, so its last token is computed: every whole block before it moves
    assert details["position_independent_tokens"] == (spans[-1][1] - 1) // 16 * 16
    plain = [dict(m, kv_reuse="prefix") for m in second]  # without the opt-in nothing moves
    c = httpx.post(f"{endpoint}/v1/chat/completions", json={**body, "messages": plain}, timeout=120).json()
    assert "position_independent_tokens" not in c["usage"]["prompt_tokens_details"]
