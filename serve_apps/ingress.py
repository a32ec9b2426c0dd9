"""The OpenAI-compatible HTTP ingress (FastAPI on Ray Serve).

It validates and tokenizes each request (off the event loop, after cheap
bounds), computes its block keys, asks the global index which node holds the
longest prefix (one call), and streams the chosen replica's events back as an
OpenAI response or as server-sent events ending in `[DONE]`. A request fans out
into one replica stream per choice (each prompt times `n`). Every client mistake
is a 4xx with an OpenAI error body (serve_apps/errors.py).
"""


import asyncio
import json
import logging
import time
from importlib import metadata

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.background import BackgroundTask

from kvcluster.actors.cluster import node_ids
from kvcluster.actors.node_control_actor import control_handle
from kvcluster.actors.index_client import open_index
from kvcluster.keys import KeySpace
from kvcluster.serving.chat import reusable_segments
from kvcluster.serving.models import model_fingerprint, load_model_tokenizer
from kvcluster.model_spec import load_model_spec

from kvcluster.actors import metrics

from . import errors
from .config import ServeAppConfig
from .errors import APIError
from .guard import TENANT_SCOPE_KEY, GuardSettings, RequestGuard, authenticate
from .logprobs import piece
from .metrics_middleware import RequestMetrics
from .prompt_encoder import PromptEncoder, PromptTooLong
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body,
                       new_id)
from .ready import announce_when_ready
from .render import Answer, ChatRender, Choice, CompletionRender, gather, merge, prompt_text, total_usage
from .replica import cache_cluster

log = logging.getLogger(__name__)
app = FastAPI(title="kvcluster OpenAI-compatible API")
app.add_middleware(RequestGuard)  # inner: key and body size, before the body is read
app.add_middleware(RequestMetrics)  # outer: counts what the guard refuses too
errors.install(app)

REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
MAX_CHOICES = 128  # prompts x n in one request


NODE_HEADER = "x-kvcluster-node"  # the cluster node whose replica answered (operators: is routing sticky?)


SESSION_HEADERS = ("x-session-id", "x-user-id")  # what load generators send when the body names no user
MAX_SESSION_CHARS = 256  # as the API's `user`


def session_of(user: str | None, headers) -> str:
    """The request's session: the API's `user`, else the first session header (LMCache's multi-round QA
    sends `x-user-id`, vLLM production-stack's router `x-session-id`); "" for none. Routing keeps a session on
    one replica and the eviction policy learns its pace."""
    if user:
        return user
    for name in SESSION_HEADERS:
        value = headers.get(name, "").strip()
        if len(value) > MAX_SESSION_CHARS:
            raise APIError(400, f"header {name} has {len(value)} characters; at most {MAX_SESSION_CHARS}", param=name)
        if value:
            return value
    return ""


def _node_headers(start: dict) -> dict[str, str]:
    return {NODE_HEADER: start["node"]} if start.get("node") else {}


def _sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


def _version() -> str:
    try:
        return metadata.version("kvcluster")
    except metadata.PackageNotFoundError:
        return "unknown"


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
        self.index = open_index(self.cfg.index_refresh_s) if self.cluster else None
        self._control: dict[str, object] = {}  # each node's controller, looked up on its first prefetch
        self._node_ids: dict[str, str] = {}
        self._node_ids_at = 0.0
        self.inflight = 0
        announce_when_ready(self.cfg.name)

    # ---- endpoints -------------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "model": self.cfg.name}

    @app.get("/version")
    async def version(self) -> dict:
        return {"version": _version()}

    def _card(self) -> dict:
        return {"id": self.cfg.name, "object": "model", "created": 0, "owned_by": "kvcluster", "root": self.cfg.model,
                "parent": None, "max_model_len": self.window}

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._tenant(request)
        return {"object": "list", "data": [self._card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> dict:
        self._tenant(request)
        self._check_model(model_id)
        return self._card()

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict:
        self._tenant(request)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt")
        if body.prompt is not None:
            ids = await self._encode(self.encoder.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        else:
            ids, _ = await self._encode(self.encoder.render(body.messages))
        strs = [piece(self.tokenizer, t)[0] for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.window, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict:
        self._tenant(request)
        self._check_model(body.model)
        self._check_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        tenant = self._tenant(request)
        self._check_common(body)
        prompts = body.prompts()
        self._check_choices(len(prompts) * body.n)
        echo_lp = body.logprobs if body.echo and body.logprobs is not None else None
        jobs = []
        for i, prompt in enumerate(prompts):
            ids = await self._prompt_ids(prompt)
            max_tokens = self._max_tokens(len(ids), body.max_tokens, "max_tokens")
            text = prompt_text(self.tokenizer, prompt) if body.echo else ""
            for j in range(body.n):
                params = body.sampling(max_tokens, j, body.logprobs, echo_lp)
                jobs.append((Choice(i * body.n + j, ids, text),
                             self._job(ids, [(1, len(ids))], params, body, tenant, request)))
        render = CompletionRender(self.tokenizer, new_id("cmpl"), self.cfg.name, body.echo, body.logprobs)
        return await self._answer(jobs, render, body)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        tenant = self._tenant(request)
        self._check_common(body)
        self._check_choices(body.n)
        ids, spans = await self._encode(self.encoder.render(body.messages))
        segments = reusable_segments(body.messages, spans)
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = self._max_tokens(len(ids), asked, "max_completion_tokens" if body.max_completion_tokens
                                      else "max_tokens")
        top = (body.top_logprobs or 0) if body.logprobs else None
        jobs = []
        for j in range(body.n):
            job = self._job(ids, [(int(t), k) for t, k in spans], body.sampling(max_tokens, j, top), body, tenant,
                            request)
            job["segments"] = segments
            jobs.append((Choice(j, ids), job))
        render = ChatRender(self.tokenizer, new_id("chatcmpl"), self.cfg.name, body.logprobs)
        return await self._answer(jobs, render, body)

    async def _answer(self, jobs: list, render, body):
        if body.stream:
            return await self._stream(jobs, render, body.n, bool(body.stream_options and
                                                                  body.stream_options.include_usage))
        answers = await self._collect(jobs)
        starts = {c.index: a.start for (c, _), a in zip(jobs, answers)}
        ends = {c.index: a.end for (c, _), a in zip(jobs, answers)}
        choices = [render.whole(c, a) for (c, _), a in zip(jobs, answers)]
        return JSONResponse(render.body(choices, total_usage(starts, ends, body.n)),
                            headers=_node_headers(answers[0].start))

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

    def _check_model(self, model: str | None) -> None:
        """`model` may be omitted (one model is served); another name is 404, as OpenAI and vLLM answer."""
        if model is not None and model != self.cfg.name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.cfg.name!r}",
                           param="model", code="model_not_found")

    def _check_common(self, body) -> None:
        self._check_model(body.model)
        problem = body.unsupported()
        if problem:
            raise APIError(400, problem[1], param=problem[0], code="unsupported")

    def _check_choices(self, count: int) -> None:
        limit = min(MAX_CHOICES, self.cfg.max_inflight_requests)
        if count > limit:
            raise APIError(400, f"this request asks for {count} choices (prompts x n); at most {limit} per request",
                           param="n")

    def _check_ids(self, ids: list[int], param: str) -> None:
        if ids and max(ids) >= self.vocab:
            raise APIError(400, f"token id {max(ids)} is outside the vocabulary (size {self.vocab})", param=param)

    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of one prompt (text tokenized off the loop, ids checked); an empty one is a 400."""
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        if isinstance(prompt, str):
            return await self._encode(self.encoder.encode(prompt))
        if len(prompt) > self.window:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's context window is {self.window}",
                           param="prompt", code="context_length_exceeded")
        self._check_ids(prompt, "prompt")
        return list(prompt)

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

    def _job(self, ids: list[int], spans, params, body, tenant: str, request: Request) -> dict:
        salt = f"{tenant}/{body.cache_salt or ''}" if tenant else (body.cache_salt or "")
        user = session_of(body.user, request.headers)
        session = f"{tenant}/{user}" if user else ""  # the end user: whose pace the policy learns
        return {"prompt_ids": ids, "spans": spans, "params": params.model_dump(), "cache_salt": salt,
                "session": session}

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
        b = self.cluster.block_tokens  # the cluster YAML's, as the replicas key blocks
        usable = (len(job["prompt_ids"]) - 1) // b
        keys = self.keyspace.chain_token_ids(job["prompt_ids"][: usable * b], b, job["cache_salt"])
        if not keys:
            return None
        try:
            match = await self.index.longest_prefix_async(keys)
        except ray.exceptions.RayError:
            return None
        name = match.best_node()
        if name is None:
            return None
        await self._prefetch_if_queued(name, keys[: match.length])
        if name not in self._node_ids or time.monotonic() - self._node_ids_at > 30:
            self._node_ids, self._node_ids_at = node_ids(self.cluster), time.monotonic()
        return self._node_ids.get(name)

    def _serving_slots(self) -> int:
        """Generations the replicas can run at once at most; past it a request waits in Serve's queue."""
        return self.cfg.max_ongoing_requests * self.cfg.autoscaling.max_replicas

    async def _prefetch_if_queued(self, node: str, keys: list[bytes]) -> bool:
        """A request that will wait behind others has its held prefix lifted into `node`'s first tier while it
        waits (one fire-and-forget call to the control plane). Only then: a request that runs at once would
        race the move and read its blocks in flight, a miss."""
        if not self.cfg.prefetch_queued or self.inflight <= self._serving_slots() or not keys:
            return False
        try:
            if node not in self._control:  # found once, by name, off the event loop (a GCS lookup)
                self._control[node] = await asyncio.to_thread(control_handle, node)
            self._control[node].prefetch.remote(keys)
        except (ValueError, ray.exceptions.RayError, TimeoutError):  # no control plane: it reads where it is
            self._control.pop(node, None)
            return False
        metrics.queued_prefetches().inc(1, {"node": node})
        return True

    def _admit(self, count: int) -> None:
        """Bounded work: past `max_inflight_requests` generations a request is turned away at once, with
        Retry-After."""
        if self.inflight + count > self.cfg.max_inflight_requests:
            metrics.faults().inc(1, {"component": "ingress", "kind": "shed"})
            raise APIError(503, f"the server is at capacity ({self.inflight} requests in flight); retry shortly",
                           kind="overloaded", code="overloaded", retry_after_s=1)
        self.inflight += count

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

    async def _collect_one(self, job: dict) -> Answer:
        """A whole non-streamed answer; a replica lost mid-way is retried (nothing was sent yet)."""
        for _ in range(self.cfg.replica_retries + 1):
            events, first = await self._first_event(job)
            try:
                return await gather(first, events)
            except REPLICA_LOST:
                metrics.faults().inc(1, {"component": "replica", "kind": "replica_lost"})
        raise APIError(503, "the model replica failed during this request; retry", kind="server_error",
                       code="replica_unavailable", retry_after_s=1)

    async def _collect(self, jobs: list) -> list[Answer]:
        self._admit(len(jobs))
        try:
            return await asyncio.gather(*(self._collect_one(job) for _, job in jobs))
        finally:
            self.inflight -= len(jobs)

    async def _stream(self, jobs: list, render, n: int, include_usage: bool):
        """Server-sent events of every choice, as each choice's replica produces them."""
        self._admit(len(jobs))
        released = False

        def release() -> None:  # idempotent: the stream's end and the response's background task both call it
            nonlocal released
            if not released:
                released = True
                self.inflight -= len(jobs)

        try:
            opened = await asyncio.gather(*(self._first_event(job) for _, job in jobs))
        except BaseException:
            release()
            raise
        bad = next((first for _, first in opened if first["type"] == "error"), None)
        if bad is not None:
            release()
            raise APIError(400, bad["message"], code="context_length_exceeded")

        async def body():
            try:
                async for chunk in merge([(c, ev, first) for (c, _), (ev, first) in zip(jobs, opened)], render, n,
                                         include_usage):
                    yield _sse(chunk)
            except Exception as exc:  # a replica died mid-stream: say so in-band, then end the stream
                log.warning("stream failed: %s", exc)
                metrics.faults().inc(1, {"component": "ingress", "kind": "stream_failed"})
                if isinstance(exc, REPLICA_LOST):
                    metrics.faults().inc(1, {"component": "replica", "kind": "replica_lost"})
                yield _sse(error_body(f"generation failed: {type(exc).__name__}; retry the request",
                                      kind="server_error"))
            finally:
                release()
            yield _sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(release),
                                 headers=_node_headers(opened[0][1]))
