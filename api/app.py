"""The FastAPI app: thin routes (parse, call ``OpenAIServing``, map errors, JSON or SSE).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{model}``, ``GET /health`` (no auth) and ``GET /debug/engine`` (the
engine's accounting: running and waiting requests, KV blocks, drafter states and fault
counters). With an API key set, every ``/v1`` and ``/debug`` route needs
``Authorization: Bearer <key>``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from .auth import check_api_key
from .errors import APIError, error_response, install_error_handlers, too_large
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import OpenAIServing

WARNING_HEADER = "X-LongSpark-Warning"


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = await request.body()
    if len(body) > limit:
        raise too_large(limit)
    return body


def _respond(result: BaseModel | AsyncIterator[str], ignored: list[str]) -> Response:
    headers = {WARNING_HEADER: f"ignored unknown fields: {', '.join(ignored)}"} if ignored else {}
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(), headers=headers)
    headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)


def create_app(serving: OpenAIServing) -> FastAPI:
    settings = serving.settings
    app = FastAPI(title="longspark-serve", summary="OpenAI-compatible speculative decoding")
    install_error_handlers(app)

    def auth(request: Request) -> None:
        check_api_key(request, settings.api_key)

    v1 = [Depends(auth)]

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request) -> Response:
        try:
            body = await _read_body(request, settings.max_request_bytes)
            req = CompletionRequest.model_validate_json(body)
            return _respond(await serving.completions(req), req.ignored_fields())
        except Exception as exc:  # noqa: BLE001 - mapped in api.errors
            return error_response(exc)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request) -> Response:
        try:
            body = await _read_body(request, settings.max_request_bytes)
            req = ChatCompletionRequest.model_validate_json(body)
            return _respond(await serving.chat(req), req.ignored_fields())
        except Exception as exc:  # noqa: BLE001 - mapped in api.errors
            return error_response(exc)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict[str, Any]:
        return serving.models().model_dump()

    @app.get("/v1/models/{model:path}", dependencies=v1)
    async def model(model: str) -> dict[str, Any]:
        return serving.model_card(model).model_dump()

    @app.get("/health")
    async def health() -> Response:
        try:
            await serving.client.health()
        except Exception as exc:  # noqa: BLE001 - mapped in api.errors
            return error_response(exc)
        return JSONResponse({"status": "ok"})

    if settings.debug_routes:

        @app.get("/debug/engine", dependencies=v1)
        async def debug_engine() -> dict[str, Any]:
            return await serving.client.stats()

    return app


__all__ = ["APIError", "create_app"]
