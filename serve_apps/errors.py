"""Every failure as an OpenAI error body, with the status codes OpenAI's and vLLM's servers use.

A malformed request (bad JSON, a wrong type, a value out of range, an unknown
field) is 400 naming the field in `param`; an unknown model 404; a body over the
limit 413 (serve_apps/guard.py); overload 503 with Retry-After; anything
unexpected 500 without internals.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import error_body

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s


def _where(error: dict) -> str:
    """The field an error is about, dotted (`messages.0.role`); list indexes and union branches left out."""
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    fields = [p for p in loc if not p.isdigit() and "[" not in p and not p.startswith("function-")]
    return ".".join(fields) or "body"


def _describe(error: dict) -> str:
    where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
    if error.get("type") == "extra_forbidden":
        return f"unknown field {where!r}: kvcluster does not support it"
    return f"{where}: {error.get('msg')}"


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse(error_body("the request body is not valid JSON", code="invalid_json"), status_code=400)
        unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
        first = (unknown or errors or [{}])[0]  # an unknown field is what the client most needs to hear about
        message = "; ".join(_describe(e) for e in (unknown or errors)[:5])
        code = "unknown_field" if unknown else "invalid_value"
        return JSONResponse(error_body(message, param=_where(first), code=code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind=kind, code=str(exc.status_code)),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", kind="server_error"),
                            status_code=500)
