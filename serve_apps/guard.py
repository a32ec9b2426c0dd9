"""First checks on every HTTP request, made on its headers before its body is read.

A raw ASGI middleware, not a FastAPI dependency: dependencies run after FastAPI
has read and parsed the body, and a client without a valid key, or with a body
over the limit, must cost the ingress no more than its headers. In order:

1. the API key (when keys are configured), compared in constant time against
   every configured key; `/health` and `/version` stay open;
2. a declared `Content-Length` over the limit is refused at once (413);
3. the body is read here, counted chunk by chunk (a chunked upload over the
   limit is refused as soon as it passes it) within a deadline (a sender that
   trickles gets 408), then replayed to the application.

The settings live on `app.state.guard` (one ingress per Serve replica process);
without them the middleware passes requests through untouched.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from dataclasses import dataclass

from .protocol import error_body

OPEN_PATHS = ("/health", "/version")
TENANT_SCOPE_KEY = "kvcluster.tenant"  # the authenticated tenant (hash of the key), for the route handlers


@dataclass(frozen=True)
class GuardSettings:
    max_body_bytes: int
    body_timeout_s: float
    api_keys: tuple[str, ...] = ()


def tenant_of(key: str) -> str:
    """The tenant id a key maps to (a short hash: it goes into block keys, never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def authenticate(header: str, keys: tuple[str, ...]) -> str | None:
    """The tenant of a `Bearer <key>` header, or None. Every key is compared (digests, constant time)."""
    given = header[7:].strip() if header[:7].lower() == "bearer " else ""
    digest = hashlib.sha256(given.encode()).digest()
    match = None
    for key in keys:
        if hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest()) and given:
            match = key
    return tenant_of(match) if match is not None else None


class RequestGuard:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        settings = getattr(getattr(scope.get("app"), "state", None), "guard", None)
        if scope["type"] != "http" or settings is None:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if settings.api_keys and not _open(scope):
            tenant = authenticate(headers.get("authorization", ""), settings.api_keys)
            if tenant is None:
                return await _reply(send, 401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                    "invalid_api_key", "authentication_error")
            scope[TENANT_SCOPE_KEY] = tenant
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _reply(send, 400, "Content-Length is not a number", "invalid_content_length")
            if int(declared) > settings.max_body_bytes:
                return await _too_large(send, int(declared), settings.max_body_bytes)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        try:
            body = await asyncio.wait_for(_read_body(receive, settings.max_body_bytes), settings.body_timeout_s)
        except asyncio.TimeoutError:
            return await _reply(send, 408, f"the request body did not arrive within {settings.body_timeout_s:g} s",
                                "request_timeout")
        if body is None:
            return await _too_large(send, None, settings.max_body_bytes)
        return await self.app(scope, _replay(body, receive), send)


def _open(scope) -> bool:
    path = scope.get("path", "")
    return any(path.endswith(p) for p in OPEN_PATHS)


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes `limit` bytes (the rest is never read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """An ASGI receive that hands out the body once, then waits on the real one (for disconnects)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _too_large(send, declared: int | None, limit: int) -> None:
    size = f"{declared} bytes" if declared is not None else f"more than {limit} bytes"
    await _reply(send, 413, f"the request body is {size}; this server accepts at most {limit} bytes "
                            "(max_request_bytes in the serve config)", "request_too_large")


async def _reply(send, status: int, message: str, code: str, kind: str = "invalid_request_error") -> None:
    """An OpenAI error body. After a timed-out body the connection is closed: what arrives later is no request.
    (A refused body is otherwise left to the HTTP server: closing while the client still sends makes its TCP
    stack reset the connection, and the client never reads the 413.)"""
    payload = json.dumps(error_body(message, kind, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + ([(b"connection", b"close")] if status == 408 else [])})
    await send({"type": "http.response.body", "body": payload})
