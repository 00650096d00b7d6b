"""The FastAPI app: thin routes (parse, call ``OpenAIServing``, map errors, JSON or SSE).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{model}``, vLLM's ``POST /tokenize`` and ``POST /detokenize``,
``GET /metrics`` (Prometheus text of the replica that answers), ``GET /version`` and
``GET /health`` (no auth), and ``GET /debug/engine`` (the engine's accounting: running
and waiting requests, KV blocks, drafter states and fault counters). With API keys set,
every route but ``/health`` and ``/version`` needs ``Authorization: Bearer <key>``.

Around them (``api.middleware``): a request id on every response and error, the in-flight
count, and 503s while draining. Request bodies are read up to ``max_request_bytes`` (413
beyond, without reading the rest); a client that goes away before its answer starts
cancels the request, which frees its sequence in the engine. CORS is off unless origins
are configured. ``/openapi.json`` documents the request bodies the routes parse
themselves, so a schema-driven fuzzer can reach them.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from api import request_id
from api.auth import check_api_key
from api.errors import (
    APIError,
    error_response,
    install_error_handlers,
    not_found,
    shutting_down,
    too_large,
)
from api.lifecycle import Lifecycle
from api.middleware import ServingMiddleware
from api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from api.serving import OpenAIServing

WARNING_HEADER = "X-LongSpark-Warning"
try:
    VERSION = importlib.metadata.version("longspark-serve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    VERSION = "0+unknown"
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer started (nobody reads the response)."""


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked bodies too: stop at the limit
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so the engine request) if the client leaves."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


def _warning(ignored: list[str]) -> dict[str, str]:
    if not ignored:
        return {}
    text = f"ignored unknown fields: {', '.join(ignored)}"
    text = "".join(c if c.isascii() and c.isprintable() else "?" for c in text)[:512]
    return {WARNING_HEADER: text}


def _respond(result: BaseModel | AsyncIterator[str], ignored: list[str]) -> Response:
    headers = _warning(ignored)
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(), headers=headers)
    headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)


def _documented(model: type[BaseModel], response: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a route that parses its own body: the body schema and the answers."""
    errors = {
        str(s): {"model": ErrorResponse, "description": d}
        for s, d in [
            (400, "invalid request"),
            (401, "missing or wrong API key"),
            (404, "unknown model"),
            (413, "body too large"),
            (429, "busy: retry after Retry-After seconds"),
            (503, "unavailable or draining: retry after Retry-After seconds"),
        ]
    }
    ok = {
        "description": "the completion, or with stream=true an event stream of chunks",
        "model": response,
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
    body = {"$ref": f"#/components/schemas/{model.__name__}"}
    extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}
    return {"responses": {"200": ok, **errors}, "openapi_extra": extra}


def _add_request_schemas(app: FastAPI) -> None:
    """Put the hand-parsed request models into ``components.schemas`` of /openapi.json."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                doc = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(doc.pop("$defs", {}))
                schemas[model.__name__] = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    serving: OpenAIServing,
    lifecycle: Lifecycle | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    echo_request_id: bool = True,
) -> FastAPI:
    """The app over ``serving``; ``lifecycle`` drains it (SIGTERM), ``lifespan`` runs
    around it (background tasks), ``echo_request_id=False`` where a proxy echoes it."""
    settings = serving.settings
    lifecycle = lifecycle or Lifecycle()
    request_id.install_log_filter()
    app = FastAPI(
        title="longspark-serve",
        summary="OpenAI-compatible speculative decoding",
        lifespan=lifespan,
    )
    app.state.lifecycle = lifecycle
    install_error_handlers(app)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=["X-Request-Id", "Retry-After", WARNING_HEADER],
        )
    app.add_middleware(ServingMiddleware, lifecycle=lifecycle, echo_request_id=echo_request_id)

    def auth(request: Request) -> None:
        check_api_key(request, settings.keys)

    v1 = [Depends(auth)]

    async def generate(request: Request, parse: Callable[[bytes], Any], run: Callable) -> Response:
        try:
            body = await _read_body(request, settings.max_request_bytes)
            req = parse(body)
            result = await _unless_disconnected(request, run(req))
            return _respond(result, req.ignored_fields())
        except ClientGone:
            return Response(status_code=499)  # nobody is there to read it
        except Exception as exc:  # noqa: BLE001 - mapped in api.errors
            return error_response(exc)

    @app.post(
        "/v1/completions", dependencies=v1, **_documented(CompletionRequest, CompletionResponse)
    )
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest.model_validate_json, serving.completions)

    @app.post(
        "/v1/chat/completions",
        dependencies=v1,
        **_documented(ChatCompletionRequest, ChatCompletionResponse),
    )
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest.model_validate_json, serving.chat)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict[str, Any]:
        return (await serving.models()).model_dump()

    @app.get("/v1/models/{model:path}", dependencies=v1)
    async def model(model: str) -> dict[str, Any]:
        return (await serving.model_card(model)).model_dump()

    async def simple(request: Request, parse: Callable[[bytes], Any], run: Callable) -> Response:
        try:
            body = await _read_body(request, settings.max_request_bytes)
            return JSONResponse((await run(parse(body))).model_dump())
        except Exception as exc:  # noqa: BLE001 - mapped in api.errors
            return error_response(exc)

    @app.post("/tokenize", dependencies=v1)
    async def tokenize(request: Request) -> Response:
        return await simple(request, TokenizeRequest.model_validate_json, serving.tokenize)

    @app.post("/detokenize", dependencies=v1)
    async def detokenize(request: Request) -> Response:
        return await simple(request, DetokenizeRequest.model_validate_json, serving.detokenize)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics", dependencies=v1)
    async def prometheus() -> Response:
        text = getattr(serving.client, "metrics_text", None)
        if text is None:
            return error_response(not_found("this server exports no metrics here"))
        try:
            body = await text()
        except Exception as exc:  # noqa: BLE001 - mapped in api.errors
            return error_response(exc)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health() -> Response:
        try:
            if lifecycle.draining:
                raise shutting_down()
            await serving.client.health()
        except Exception as exc:  # noqa: BLE001 - mapped in api.errors
            return error_response(exc)
        return JSONResponse({"status": "ok"})

    if settings.debug_routes:

        @app.get("/debug/engine", dependencies=v1)
        async def debug_engine() -> dict[str, Any]:
            return await serving.client.stats()

    _add_request_schemas(app)
    return app


__all__ = ["APIError", "create_app"]
