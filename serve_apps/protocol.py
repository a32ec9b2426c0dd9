"""The OpenAI wire format: request models (validated) and response bodies.

Unknown fields are ignored as OpenAI's server does; wrong types and values out
of range are 422 errors naming the field; features kvcluster does not implement
(n > 1, logprobs, echo) are 400 errors saying so, never silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvcluster.serving.chat import ChatMessage
from kvcluster.serving.sampling import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, max_length=256, description="Tenant salt: blocks are shared only within it.")
    logprobs: bool | int | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    def unsupported(self) -> str | None:
        if self.n != 1:
            return "n > 1 is not supported; send one request per completion"
        if self.logprobs:
            return "logprobs are not supported"
        return None

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, stop=tuple(self.stop or ()),
                              seed=self.seed, ignore_eos=self.ignore_eos)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field(description="Text, token ids, or a list of one text.")
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("a list of prompts is not supported; send one request per prompt")
            return v[0]
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    def unsupported(self) -> str | None:
        return "echo is not supported" if self.echo else super().unsupported()


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("messages")
    @classmethod
    def _texts(cls, v):
        for m in v:
            m.text()  # raises on non-text parts
        return v


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


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict | None,
                    chunk: bool = False) -> dict:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
    if use is not None or not chunk:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, text: str, finish: str | None, use: dict | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": None}], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None, use: dict | None = None,
               choices: bool = True) -> dict:
    body: dict = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if choices else []}
    if use is not None:
        body["usage"] = use
    return body


Role = Literal["system", "user", "assistant", "tool"]
