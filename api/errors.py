"""Every failure becomes an OpenAI-shaped error here, and only here.

``{"error": {"message", "type", "param", "code"}}`` with the status that fits:

======================================================  ======  ========================
cause                                                   status  type / code
======================================================  ======  ========================
malformed JSON, wrong types, missing fields (pydantic)  400     invalid_request_error
bad setting (``InvalidRequest``), unsupported field     400     invalid_request_error
prompt longer than the context (``TargetConfigError``)  400     ... / context_length_exceeded
missing or wrong API key                                401     authentication_error
unknown model, unknown route                            404     not_found_error
body over the size limit                                413     request_too_large
too many queued requests (Serve back-pressure)          429     rate_limit_exceeded
replica lost a target rank, no replica available        503     service_unavailable
anything else                                           500     internal_error
======================================================  ======  ========================

Exceptions arriving from the engine deployment are Ray's wrappers around the original;
:func:`services.errors.unwrap` finds the original first.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.async_engine import EngineDeadError, RequestFailed
from services.errors import unwrap, user_error_message
from services.sampling import InvalidRequest
from services.serve_drafter import DrafterUnavailable
from target_actor.config import TargetConfigError

from .protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("longspark.api")


class APIError(Exception):
    """An error with its HTTP status and OpenAI fields (raised by the api layer itself)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, "not_found_error", param, "model_not_found" if param else None)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def too_large(limit: int) -> APIError:
    message = f"the request body is over {limit} bytes"
    return APIError(413, message, "invalid_request_error", None, "request_too_large")


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


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception (ours, pydantic's, Ray's, Serve's) to an :class:`APIError`."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return _validation_error(list(exc.errors()))
    if isinstance(exc, BackPressureError):
        return APIError(
            429, "the server is busy; retry later", "rate_limit_exceeded", None, "server_busy"
        )
    cause = unwrap(exc)
    message = user_error_message(cause)
    if isinstance(cause, InvalidRequest):
        return APIError(400, message, param=cause.param, code="invalid_value")
    if isinstance(cause, TargetConfigError):
        return APIError(400, message, code="context_length_exceeded")
    if isinstance(cause, (EngineDeadError, DeploymentUnavailableError, DrafterUnavailable)):
        return APIError(503, str(cause), "service_unavailable", None, "replica_unavailable")
    if isinstance(cause, RayActorError) or isinstance(exc, RayActorError):
        message = "the model replica went away; retry"
        return APIError(503, message, "service_unavailable", None, "replica_unavailable")
    if isinstance(cause, RequestFailed):
        return APIError(500, str(cause), "internal_error", None, "engine_error")
    log.error("unexpected error: %s", message, exc_info=exc)
    return APIError(500, f"internal error: {message}", "internal_error", None, "internal_error")


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> JSONResponse:
    err = to_api_error(exc)
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


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
        return JSONResponse(err.body(), status_code=err.status, headers=exc.headers)

    app.add_exception_handler(APIError, handle)
    app.add_exception_handler(RequestValidationError, handle)
    app.add_exception_handler(StarletteHTTPException, handle_http)
    app.add_exception_handler(Exception, handle)
