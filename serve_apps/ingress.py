"""The OpenAI-compatible HTTP ingress (FastAPI on Ray Serve).

It validates and tokenizes each request, computes its block keys, asks the
global index which node holds the longest prefix (one call), and streams the
chosen replica's events back as an OpenAI response or as server-sent events
ending in `[DONE]`. Every client mistake is a 4xx with an OpenAI error body.
"""


import asyncio
import json
import logging
import time

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.cluster import node_ids
from actors.index_actor import INDEX_NAME, NAMESPACE
from kvcluster.keys import KeySpace
from kvcluster.serving.chat import reusable_segments
from kvcluster.serving.models import model_fingerprint, load_model_tokenizer
from kvcluster.model_spec import load_model_spec

from actors import metrics

from .config import ServeAppConfig
from .guard import TENANT_SCOPE_KEY, GuardSettings, RequestGuard, authenticate
from .metrics_middleware import RequestMetrics
from .prompt_encoder import PromptEncoder, PromptTooLong
from .protocol import (ChatCompletionRequest, CompletionRequest, chat_body, chat_chunk, completion_body, error_body,
                       new_id, usage)
from .replica import cache_cluster

log = logging.getLogger(__name__)
app = FastAPI(title="kvcluster OpenAI-compatible API")
app.add_middleware(RequestGuard)  # inner: key and body size, before the body is read
app.add_middleware(RequestMetrics)  # outer: counts what the guard refuses too


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s


REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError):
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status,
                        headers=headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError):
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return JSONResponse(error_body("the request body is not valid JSON", param=None, code="invalid_json"),
                            status_code=400)
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc) or "body"
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors[:5])
    return JSONResponse(error_body(message, param=where, code="invalid_value"), status_code=422)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException):
    return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)


@app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception):
    log.exception("internal error")
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", kind="server_error"), status_code=500)


async def _gather(first: dict, events) -> tuple[dict, str, dict]:
    """(start event, text, end event) of one replica stream."""
    start, parts, end, event = None, [], None, first
    while True:
        if event["type"] == "error":
            raise APIError(400, event["message"], code="context_length_exceeded")
        if event["type"] == "start":
            start = event
        elif event["type"] == "delta":
            parts.append(event["text"])
        elif event["type"] == "end":
            end = event
        try:
            event = await events.__anext__()
        except StopAsyncIteration:
            return start, "".join(parts), end


NODE_HEADER = "x-kvcluster-node"  # the cluster node whose replica answered (operators: is routing sticky?)


def _node_headers(start: dict) -> dict[str, str]:
    return {NODE_HEADER: start["node"]} if start.get("node") else {}


def _answered(start: dict, body: dict) -> JSONResponse:
    return JSONResponse(body, headers=_node_headers(start))


def _sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, replica, config: dict) -> None:
        self.cfg = ServeAppConfig.model_validate(config)
        self.replica = replica
        self.tokenizer = load_model_tokenizer(self.cfg.model)
        spec = load_model_spec(self.cfg.model)
        self.window = spec.max_position_embeddings or 2048
        self.vocab = int(spec.hf_config.get_text_config().vocab_size)
        # routing keys must equal the replicas' (a mismatch only loses prefix affinity, never correctness):
        # computed here first, then taken from a replica once one answers (device: auto resolves per process,
        # and random weights drawn on a GPU replica differ from a CPU ingress's)
        fingerprint = model_fingerprint(self.cfg.model, self.cfg.dtype, self.cfg.seed, self.cfg.resolved_device())
        self.keyspace = KeySpace(fingerprint, self.cfg.root_seed)
        self._keyspace_confirmed = False
        self._keyspace_asked_at = float("-inf")
        self._keyspace_task: asyncio.Task | None = None
        self.api_keys = tuple(self.cfg.keys())
        app.state.guard = GuardSettings(self.cfg.max_request_bytes, self.cfg.request_body_timeout_s, self.api_keys)
        self.encoder = PromptEncoder(self.tokenizer, self.window, self.cfg.tokenizer_threads)
        self.cluster = cache_cluster(self.cfg)
        self.index = ray.get_actor(INDEX_NAME, namespace=NAMESPACE) if self.cluster else None
        self._node_ids: dict[str, str] = {}
        self._node_ids_at = 0.0
        self.inflight = 0

    # ---- endpoints -------------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "model": self.cfg.name}

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._tenant(request)
        return {"object": "list", "data": [{"id": self.cfg.name, "object": "model", "created": 0,
                                            "owned_by": "kvcluster", "max_model_len": self.window}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        tenant = self._tenant(request)
        self._check_common(body)
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise APIError(400, "prompt is empty", param="prompt")
            ids = await self._encode(self.encoder.encode(body.prompt))
        else:
            ids = list(body.prompt)
            if not ids:
                raise APIError(400, "prompt is empty", param="prompt")
            if max(ids) >= self.vocab:
                raise APIError(400, f"token id {max(ids)} is outside the vocabulary (size {self.vocab})",
                               param="prompt")
        max_tokens = self._max_tokens(len(ids), body.max_tokens, "max_tokens")
        job = self._job(ids, [(1, len(ids))], body, max_tokens, tenant)
        rid = new_id("cmpl")
        if body.stream:
            return await self._stream(job, rid, chat=False, include_usage=bool(body.stream_options and
                                                                                body.stream_options.include_usage))
        start, text, end = await self._collect(job)
        return _answered(start, completion_body(rid, self.cfg.name, text, end["finish_reason"],
                                                usage(start["prompt_tokens"], end["completion_tokens"],
                                                      start["cached_tokens"], start.get("segment_tokens", 0))))

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        tenant = self._tenant(request)
        self._check_common(body)
        ids, spans = await self._encode(self.encoder.render(body.messages))
        segments = reusable_segments(body.messages, spans)
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = self._max_tokens(len(ids), asked, "max_completion_tokens" if body.max_completion_tokens
                                      else "max_tokens")
        job = self._job(ids, [(int(t), n) for t, n in spans], body, max_tokens, tenant)
        job["segments"] = segments
        rid = new_id("chatcmpl")
        if body.stream:
            return await self._stream(job, rid, chat=True, include_usage=bool(body.stream_options and
                                                                               body.stream_options.include_usage))
        start, text, end = await self._collect(job)
        return _answered(start, chat_body(rid, self.cfg.name, text, end["finish_reason"],
                                          usage(start["prompt_tokens"], end["completion_tokens"],
                                                start["cached_tokens"], start.get("segment_tokens", 0))))

    # ---- helpers ---------------------------------------------------------------------------------------

    def _tenant(self, request: Request) -> str:
        """The tenant (a hash of the API key) the guard authenticated, or "" when auth is off."""
        if not self.api_keys:
            return ""
        tenant = request.scope.get(TENANT_SCOPE_KEY) or authenticate(request.headers.get("authorization", ""),
                                                                     self.api_keys)
        if tenant is None:
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key", kind="authentication_error")
        return tenant

    async def _encode(self, work):
        """Await tokenization (in the encoder's pool); a text that cannot fit the window is a 400 naming it."""
        try:
            return await work
        except PromptTooLong as exc:
            raise APIError(400, str(exc), param=exc.param, code="context_length_exceeded") from None

    def _check_common(self, body) -> None:
        if body.model != self.cfg.name:
            raise APIError(400, f"the model {body.model!r} does not exist; this server serves {self.cfg.name!r}",
                           param="model", code="model_not_found")
        problem = body.unsupported()
        if problem:
            raise APIError(400, problem, code="unsupported")

    def _max_tokens(self, prompt_tokens: int, asked: int | None, field: str) -> int:
        room = self.window - prompt_tokens
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_tokens} tokens; this model's context window is "
                                f"{self.window}", param="messages" if field != "max_tokens" else "prompt",
                           code="context_length_exceeded")
        if asked is None:
            return min(self.cfg.default_chat_max_tokens, room)
        if asked > self.cfg.max_tokens_limit:
            raise APIError(400, f"{field} is {asked}; this server allows at most {self.cfg.max_tokens_limit}",
                           param=field)
        if asked > room:
            raise APIError(400, f"this model's context window is {self.window} tokens; the prompt has "
                                f"{prompt_tokens} and {field} asks for {asked}", param=field,
                           code="context_length_exceeded")
        return asked

    def _job(self, ids: list[int], spans, body, max_tokens: int, tenant: str) -> dict:
        salt = f"{tenant}/{body.cache_salt or ''}" if tenant else (body.cache_salt or "")
        return {"prompt_ids": ids, "spans": spans, "params": body.sampling(max_tokens).model_dump(),
                "cache_salt": salt}

    def _confirm_keyspace(self) -> None:
        """Ask a replica for its model fingerprint in the background (at most every 10 s until it answers);
        requests route with the locally computed keys meanwhile, never waiting for it."""
        if self._keyspace_confirmed or time.monotonic() - self._keyspace_asked_at < 10:
            return
        if self._keyspace_task is not None and not self._keyspace_task.done():
            return
        self._keyspace_asked_at = time.monotonic()
        self._keyspace_task = asyncio.get_running_loop().create_task(self._adopt_replica_keyspace())

    async def _adopt_replica_keyspace(self) -> None:
        try:
            info = await asyncio.wait_for(self.replica.info.remote(), timeout=30)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            return
        if info.get("fingerprint") and info["fingerprint"] != self.keyspace.model:
            log.info("routing keys follow the replicas' model fingerprint %s", info["fingerprint"])
            self.keyspace = KeySpace(info["fingerprint"], self.cfg.root_seed)
        self._keyspace_confirmed = True

    async def _route(self, job: dict) -> str | None:
        """Ray node id of the node holding the longest prefix of the prompt (None: no preference)."""
        if self.index is None:
            return None
        self._confirm_keyspace()
        b = self.cfg.block_tokens
        usable = (len(job["prompt_ids"]) - 1) // b
        keys = self.keyspace.chain_token_ids(job["prompt_ids"][: usable * b], b, job["cache_salt"])
        if not keys:
            return None
        try:
            match = await self.index.longest_prefix.remote(keys)
        except ray.exceptions.RayError:
            return None
        name = match.best_node()
        if name is None:
            return None
        if name not in self._node_ids or time.monotonic() - self._node_ids_at > 30:
            self._node_ids, self._node_ids_at = node_ids(self.cluster), time.monotonic()
        return self._node_ids.get(name)

    def _admit(self) -> None:
        """Bounded work: past `max_inflight_requests` a request is turned away at once, with Retry-After."""
        if self.inflight >= self.cfg.max_inflight_requests:
            metrics.faults().inc(1, {"component": "ingress", "kind": "shed"})
            raise APIError(503, f"the server is at capacity ({self.inflight} requests in flight); retry shortly",
                           kind="overloaded", code="overloaded", retry_after_s=1)
        self.inflight += 1

    async def _events(self, job: dict):
        node = await self._route(job)
        async for event in self.replica.options(stream=True).generate.remote(job, prefer_node=node):
            yield event

    async def _first_event(self, job: dict):
        """The replica's event stream and its first event; a replica lost before answering is retried."""
        for attempt in range(self.cfg.replica_retries + 1):
            events = self._events(job)
            try:
                return events, await events.__anext__()
            except REPLICA_LOST as exc:
                metrics.faults().inc(1, {"component": "replica", "kind": "replica_lost"})
                log.warning("replica lost before the first token (attempt %d): %s", attempt + 1, type(exc).__name__)
        raise APIError(503, "the model replica failed while starting this request; retry", kind="server_error",
                       code="replica_unavailable", retry_after_s=1)

    async def _collect(self, job: dict):
        """A whole non-streamed answer; a replica lost mid-way is retried (nothing was sent yet)."""
        self._admit()
        try:
            for attempt in range(self.cfg.replica_retries + 1):
                events, first = await self._first_event(job)
                try:
                    return await _gather(first, events)
                except REPLICA_LOST:
                    metrics.faults().inc(1, {"component": "replica", "kind": "replica_lost"})
            raise APIError(503, "the model replica failed during this request; retry", kind="server_error",
                           code="replica_unavailable", retry_after_s=1)
        finally:
            self.inflight -= 1

    async def _stream(self, job: dict, rid: str, chat: bool, include_usage: bool):
        self._admit()
        try:
            events, first = await self._first_event(job)
        except BaseException:
            self.inflight -= 1
            raise
        if first["type"] == "error":
            self.inflight -= 1
            raise APIError(400, first["message"], code="context_length_exceeded")
        name = self.cfg.name
        released = False

        def release() -> None:  # idempotent: the stream's end and the response's background task both call it
            nonlocal released
            if not released:
                released = True
                self.inflight -= 1

        async def body():
            start = first
            try:
                if chat:
                    yield _sse(chat_chunk(rid, name, {"role": "assistant", "content": ""}, None))
                async for event in events:
                    if event["type"] == "delta":
                        yield _sse(chat_chunk(rid, name, {"content": event["text"]}, None) if chat else
                                   completion_body(rid, name, event["text"], None, None, chunk=True))
                    elif event["type"] == "end":
                        use = usage(start["prompt_tokens"], event["completion_tokens"], start["cached_tokens"],
                                    start.get("segment_tokens", 0))
                        yield _sse(chat_chunk(rid, name, {}, event["finish_reason"]) if chat else
                                   completion_body(rid, name, "", event["finish_reason"], None, chunk=True))
                        if include_usage:
                            yield _sse(chat_chunk(rid, name, {}, None, use, choices=False) if chat else
                                       {**completion_body(rid, name, "", None, use, chunk=True), "choices": []})
            except Exception as exc:  # the replica died mid-stream: say so in-band, then end the stream
                log.warning("stream %s failed: %s", rid, exc)
                metrics.faults().inc(1, {"component": "ingress", "kind": "stream_failed"})
                if isinstance(exc, REPLICA_LOST):
                    metrics.faults().inc(1, {"component": "replica", "kind": "replica_lost"})
                yield _sse(error_body(f"generation failed: {type(exc).__name__}; retry the request",
                                      kind="server_error"))
            finally:
                release()
            yield _sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(release),
                                 headers=_node_headers(first))
