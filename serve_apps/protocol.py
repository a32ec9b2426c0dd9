"""The OpenAI wire format: request models (validated) and response bodies.

Requests are strict: an unknown field is a 400 naming it, never silently
ignored; a wrong type or a value out of range is a 400 naming the field (as
vLLM's and OpenAI's servers answer). OpenAI fields kvcluster does not implement
(penalties, logit_bias, tools, response formats, suffix, best_of) are accepted
only at their neutral value; anything else is a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvcluster.serving.chat import ChatMessage
from kvcluster.serving.sampling import SamplingParams

MAX_STOP_CHARS = 256  # a stop string is held back from the stream while it may be forming: keep it short
MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="Accepted (vLLM's field); usage comes in the last chunk.")


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1, description="May be omitted: one model is served.")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="Sample among the k most likely tokens; -1, 0 or null: all.")
    min_tokens: int = Field(0, ge=0, description="Neither end-of-sequence nor a stop string ends the answer before "
                                                 "this many tokens.")
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = Field(None, max_length=256)
    cache_salt: str | None = Field(None, max_length=256, description="Tenant salt: blocks are shared only within it.")
    ignore_eos: bool = False
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0 (a 400 otherwise).")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0 (a 400 otherwise).")
    logit_bias: dict[str, float] | None = Field(None, description="Only empty (a 400 otherwise).")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return stops

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first field set to something kvcluster cannot do, or None."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None

    def sampling(self, max_tokens: int, choice: int = 0, logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
        """The runner's parameters for choice `choice` of this request (choice i samples with seed + i)."""
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k or 0, 0),
                              min_tokens=min(self.min_tokens, max_tokens), stop=tuple(self.stop or ()),
                              seed=None if self.seed is None else self.seed + choice, ignore_eos=self.ignore_eos,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="A text, token ids, or a list of either (one choice set per prompt).")
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = Field(False, description="The answer starts with the prompt (with logprobs: the prompt's too, "
                                          "computed without the cache).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Each token's log-probability and this "
                                                                         "many most likely alternatives.")
    suffix: str | None = Field(None, description="Not supported (a 400 when set).")
    best_of: int | None = Field(None, ge=1, description="Only equal to n (a 400 otherwise).")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], list):
            ids = [t for p in v for t in p]
        else:
            ids = v if isinstance(v, list) and v and isinstance(v[0], int) else []
        if any(t < 0 for t in ids):
            raise ValueError("token ids must be non-negative")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or each of a list."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (only equal to n)"
        return super().unsupported()


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="Each output token's log-probability (`choices[].logprobs.content`).")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token (needs "
                                                                             "logprobs: true).")
    tools: list[dict] | None = Field(None, description="Tool calling is not supported: only empty (a 400 otherwise).")
    tool_choice: str | dict | None = Field(None, description="Only \"none\" (a 400 otherwise).")
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored (no tools).")
    response_format: dict | None = Field(None, description="Only {\"type\": \"text\"} (a 400 otherwise).")

    @field_validator("messages")
    @classmethod
    def _texts(cls, v):
        for m in v:
            m.text()  # raises on non-text parts
        return v

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool calling is not supported (tool_choice may only be \"none\")"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", "only response_format {\"type\": \"text\"} is supported"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered as /v1/chat/completions renders them."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = Field(True, description="With a prompt: prepend BOS as completions do.")
    return_token_strs: bool = Field(False, description="Also the text piece of each token.")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, min_length=1)
    tokens: list[int] = Field(max_length=1 << 16)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, segment_tokens: int = 0) -> dict:
    """OpenAI usage; `cached_tokens` is the exact prefix hit, `position_independent_tokens` (a kvcluster
    extension) the tokens of `kv_reuse: anywhere` messages reused from another offset."""
    details = {"cached_tokens": cached_tokens}
    if segment_tokens:
        details["position_independent_tokens"] = segment_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": details}


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion_body(rid: str, model: str, choices: list[dict], use: dict | None, chunk: bool = False) -> dict:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body


def chat_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
            "logprobs": logprobs}


def chat_body(rid: str, model: str, choices: list[dict], use: dict | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": use}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish: str | None, logprobs: dict | None = None,
               use: dict | None = None, choices: bool = True) -> dict:
    body: dict = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                  "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
                  if choices else []}
    if use is not None:
        body["usage"] = use
    return body
