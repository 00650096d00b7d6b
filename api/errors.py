"""Every failure becomes an OpenAI-shaped error here, and only here.

``{"error": {"message", "type", "param", "code"}, "request_id": ...}`` with the status that
fits (``request_id`` is the one echoed in ``X-Request-Id``; see ``api.request_id``). Every
429 and 503 carries ``Retry-After`` (seconds).

======================================================  ======  ========================
cause                                                   status  type / code
======================================================  ======  ========================
malformed JSON, wrong types, missing fields (pydantic)  400     invalid_request_error
a header value that is not UTF-8 (``api.proxy_guard``)  400     ... / invalid_header
bad setting (``InvalidRequest``), unsupported field     400     invalid_request_error
max_tokens over the server's cap                        400     ... / invalid_value
prompt over the context or the server's prompt limit    400     ... / context_length_exceeded
missing or wrong API key                                401     authentication_error
unknown model, unknown route                            404     not_found_error
body over the size limit                                413     request_too_large
too many queued requests (Serve back-pressure, engine   429     rate_limit_exceeded /
waiting queue full: ``EngineOverloaded``)                       server_busy
waited in the queue too long (``QueueTimeout``)         503     service_unavailable /
                                                                queue_timeout
shutting down (draining after SIGTERM)                  503     ... / shutting_down
replica lost a target rank, no replica available        503     ... / replica_unavailable
anything else                                           500     internal_error
======================================================  ======  ========================

Exceptions arriving from the engine deployment are Ray's wrappers around the original;
:func:`services.engine.errors.unwrap` finds the original first.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import request_id
from api.protocol import ErrorInfo
from services.engine.async_engine import (
    EngineDeadError,
    EngineOverloaded,
    QueueTimeout,
    RequestFailed,
)
from services.engine.errors import TargetConfigError, is_fatal, unwrap, user_error_message
from services.engine.params import InvalidRequest

log = logging.getLogger("longspark.api")

RETRY_AFTER_BUSY_S = 1  # 429: the queue is full now; it drains quickly
RETRY_AFTER_UNAVAILABLE_S = 5  # 503: a replica is being replaced, or the server drains


class APIError(Exception):
    """An error with its HTTP status and OpenAI fields (raised by the api layer itself)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        out: dict[str, Any] = {"error": info.model_dump()}
        rid = request_id.current()
        if rid is not None:
            out["request_id"] = rid
        return out

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, "not_found_error", param, "model_not_found" if param else None)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def too_large(limit: int) -> APIError:
    message = f"the request body is over {limit} bytes"
    return APIError(413, message, "invalid_request_error", None, "request_too_large")


def busy(message: str) -> APIError:
    return APIError(
        429, message, "rate_limit_exceeded", None, "server_busy", retry_after=RETRY_AFTER_BUSY_S
    )


def unavailable(message: str, code: str) -> APIError:
    return APIError(
        503, message, "service_unavailable", None, code, retry_after=RETRY_AFTER_UNAVAILABLE_S
    )


def shutting_down() -> APIError:
    return unavailable("the server is shutting down; retry on another replica", "shutting_down")


def _validation_error(errors: list[dict[str, Any]]) -> APIError:
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('msg')}", code="json_invalid")
    # union members show up as loc entries like "str" / "list[int]": keep the field path
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float")]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


TRANSLATORS: list[Callable[[BaseException], APIError | None]] = []


def add_translator(fn: Callable[[BaseException], APIError | None]) -> None:
    """Map exceptions this package cannot name (Ray Serve's, from ``services.serving``)."""
    if fn not in TRANSLATORS:
        TRANSLATORS.append(fn)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception (ours, pydantic's, Ray's, Serve's) to an :class:`APIError`."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return _validation_error(list(exc.errors()))
    for translate in TRANSLATORS:
        if (err := translate(exc)) is not None:
            return err
    cause = unwrap(exc)
    message = user_error_message(cause)
    if isinstance(cause, InvalidRequest):
        return APIError(400, message, param=cause.param, code="invalid_value")
    if isinstance(cause, TargetConfigError):
        return APIError(400, message, code="context_length_exceeded")
    if isinstance(cause, EngineOverloaded):
        return busy(message)
    if isinstance(cause, QueueTimeout):
        return unavailable(message, "queue_timeout")
    if isinstance(cause, EngineDeadError):
        return unavailable(str(cause), "replica_unavailable")
    if is_fatal(exc):  # a Ray actor of the replica died
        return unavailable("the model replica went away; retry", "replica_unavailable")
    if isinstance(cause, RequestFailed):
        return APIError(500, str(cause), "internal_error", None, "engine_error")
    log.error("unexpected error: %s", message, exc_info=exc)
    return APIError(500, f"internal error: {message}", "internal_error", None, "internal_error")


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> JSONResponse:
    err = to_api_error(exc)
    return JSONResponse(
        err.body(), status_code=err.status, headers={**err.headers(), **(headers or {})}
    )


def sse_error(exc: BaseException) -> str:
    """An error inside an event stream (the status line was already sent)."""
    return f"data: {json.dumps(to_api_error(exc).body())}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped errors for what FastAPI/Starlette raise before a route runs."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    async def handle_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            exc.status_code, "invalid_request_error"
        )
        err = APIError(exc.status_code, str(exc.detail), kind)
        return error_response(err, headers=exc.headers)

    app.add_exception_handler(APIError, handle)
    app.add_exception_handler(RequestValidationError, handle)
    app.add_exception_handler(StarletteHTTPException, handle_http)
    app.add_exception_handler(Exception, handle)
