"""OpenAI API conformance (issue 21), with the official `openai` client against the endpoint on Ray Serve.

Status codes as OpenAI's and vLLM's servers give them, n > 1, logprobs (completions
and chat), echo, a list of prompts, UTF-8 held back while a character is incomplete,
/v1/models/{id}, /version, /tokenize and /detokenize, `model` omitted, top_k,
min_tokens, and unknown or unsupported fields refused by name. Greedy answers are
compared with the in-process model run without any cache.
"""

from __future__ import annotations

import math

import httpx
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from kvcluster.serving.chat import ChatMessage, render_chat  # noqa: E402
from kvcluster.serving.runner import Generation  # noqa: E402
from kvcluster.serving.sampling import SamplingParams  # noqa: E402
from serving_support import DOC, MODEL  # noqa: E402

PROMPT = "Conformance: " + DOC[:160]


def greedy(reference, prompt: str | list[int], max_tokens: int) -> str:
    ids = reference.loaded.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return reference.complete(ids, SamplingParams(max_tokens=max_tokens, temperature=0)).text


def test_status_codes_and_fields_refused_by_name(client, endpoint):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature="hot")
    assert err.value.body["param"] == "temperature"
    cases = {"repetition_penalty": 1.2, "best_of": 3, "frequency_penalty": 0.5, "suffix": "end", "logit_bias": {"5": 1}}
    for field, value in cases.items():
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={field: value})
        assert err.value.body["param"] == field, (field, err.value.body)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for field, value in {"tools": [tool], "tool_choice": "required", "response_format": {"type": "json_object"},
                         "top_logprobs": 2, "metadata": {"a": "b"}}.items():
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                           extra_body={field: value})
        assert err.value.body["param"] == field, (field, err.value.body)
    neutral = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                             frequency_penalty=0, tool_choice="none", response_format={"type": "text"})
    assert neutral.choices[0].finish_reason in ("length", "stop")
    r = httpx.post(f"{endpoint}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)  # no model
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_n_choices_and_a_list_of_prompts(client, reference):
    other = "Second prompt: " + DOC[200:320]
    out = client.completions.create(model=MODEL, prompt=[PROMPT, other], n=2, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    expected = [greedy(reference, PROMPT, 6)] * 2 + [greedy(reference, other, 6)] * 2
    assert [c.text for c in out.choices] == expected
    tok = reference.loaded.tokenizer
    assert out.usage.prompt_tokens == len(tok.encode(PROMPT)) + len(tok.encode(other))  # once per prompt
    ids = tok.encode(other)
    assert client.completions.create(model=MODEL, prompt=[ids], max_tokens=6, temperature=0).choices[0].text == \
        expected[2]
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=1.0, seed=5)
    sampled = client.chat.completions.create(n=3, **kwargs)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    again = client.chat.completions.create(n=3, **kwargs)  # choice i samples with seed + i: repeatable
    assert [c.message.content for c in sampled.choices] == [c.message.content for c in again.choices]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=6, temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: expected[0], 1: expected[0]}


def test_logprobs_match_the_model(client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens == 4
    assert "".join(lp.tokens).lstrip() == out.choices[0].text.lstrip() and lp.text_offset[0] == 0
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(v, abs=1e-5)  # greedy: the top choice
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    ids = reference.loaded.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        logits = reference.loaded.model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert lp.token_logprobs[0] == pytest.approx(float(torch.log_softmax(logits.float(), -1).max()), abs=1e-4)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and t.bytes for t in content)
    assert math.isclose(content[0].logprob, content[0].top_logprobs[0].logprob, abs_tol=1e-5)


def test_echo_with_and_without_logprobs(client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert out.choices[0].text == PROMPT + greedy(reference, PROMPT, 3)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    prompt_tokens = out.usage.prompt_tokens
    assert len(lp.tokens) == prompt_tokens + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and out.usage.prompt_tokens_details.cached_tokens == 0


def test_models_version_tokenize_detokenize(client, endpoint, reference):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    version = httpx.get(f"{endpoint}/version", timeout=30).json()["version"]
    assert version and version != "unknown"
    tok = reference.loaded.tokenizer
    r = httpx.post(f"{endpoint}/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=60).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 4096
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = httpx.post(f"{endpoint}/tokenize", json={"messages": messages}, timeout=60).json()
    assert r["tokens"] == render_chat(tok, [ChatMessage(**m) for m in messages])[0]
    back = httpx.post(f"{endpoint}/detokenize", json={"tokens": tok.encode("Hello world", add_special_tokens=False)},
                      timeout=60).json()
    assert back == {"prompt": "Hello world"}
    r = httpx.post(f"{endpoint}/detokenize", json={"tokens": [99999]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_top_k_and_min_tokens_are_applied(client, reference):
    plain = greedy(reference, PROMPT, 8)
    top1 = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                     extra_body={"top_k": 1})
    assert top1.choices[0].text == plain  # sampling among one token is greedy
    stop = plain.strip()[1:3]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and len(cut.choices[0].text) < len(plain)
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"min_tokens": 8})
    assert held.choices[0].text == plain  # no stop string ends it before min_tokens


def test_streamed_text_never_splits_a_character(reference):
    """Byte tokens of one character (€ = E2 82 AC) stream as nothing until the character is whole."""
    vocab = reference.loaded.tokenizer.get_vocab()
    ids = [vocab["\u2581The"], vocab["<0xE2>"], vocab["<0x82>"], vocab["<0xAC>"], vocab["\u2581scale"]]
    gen = Generation([1], SamplingParams(max_tokens=16), "")
    deltas = []
    for token in ids:
        reference._accept(gen, token)
        deltas.append(reference.new_text(gen))
    assert deltas == ["The", "", "", "\u20ac", " scale"]


def test_streamed_sampled_text_equals_the_whole_answer(client):
    for seed in (1, 2, 3):
        kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=seed)
        whole = client.completions.create(**kwargs).choices[0].text
        parts = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
        assert "".join(parts) == whole
        assert not any(p.endswith("\ufffd") for p in parts[:-1] if p)  # a held-back byte never ends a chunk


def test_readiness_line_names_the_url_once_running():
    from kvcluster.serve_apps.ready import endpoint_url

    details = {"http_options": {"host": "0.0.0.0", "port": 8000},
               "applications": {"kvcluster": {"status": "DEPLOYING", "route_prefix": "/"}}}
    assert endpoint_url(details, "kvcluster") is None
    details["applications"]["kvcluster"]["status"] = "RUNNING"
    assert endpoint_url(details, "kvcluster") == "http://0.0.0.0:8000/v1"
    details["applications"]["kvcluster"]["route_prefix"] = "/secure"
    assert endpoint_url(details, "kvcluster") == "http://0.0.0.0:8000/secure/v1"
    assert endpoint_url(details, "other") is None
