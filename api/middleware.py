"""The ASGI layer around every request: request id, draining, and the in-flight count.

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``), so the request id's
context variable reaches the route and the streaming body, and the in-flight count
covers a stream until its last byte is sent.
"""

from __future__ import annotations

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import request_id
from api.errors import busy, error_response, shutting_down
from api.lifecycle import Lifecycle


def is_generation(scope: Scope) -> bool:
    """The requests that start work in the engine (the ones a drain waits for)."""
    return scope["method"] == "POST" and scope["path"].startswith("/v1/")


class ServingMiddleware:
    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, echo_request_id: bool = True):
        self.app, self.lifecycle, self.echo_request_id = app, lifecycle, echo_request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id.choose(Headers(scope=scope).get(request_id.HEADER))
        token = request_id.bind(rid)

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.echo_request_id:
                    MutableHeaders(scope=message)[request_id.HEADER] = rid
            await send(message)

        try:
            if not is_generation(scope):
                await self.app(scope, receive, send_with_id)
            elif self.lifecycle.draining:
                await error_response(shutting_down())(scope, receive, send_with_id)
            elif self.lifecycle.full:
                await error_response(busy("the server is busy; retry later"))(
                    scope, receive, send_with_id
                )
            else:
                self.lifecycle.enter()
                try:
                    await self.app(scope, receive, send_with_id)
                finally:
                    self.lifecycle.leave()
        except Exception as exc:  # noqa: BLE001 - an OpenAI error, never a bare traceback
            if started:
                raise
            await error_response(exc)(scope, receive, send_with_id)
        finally:
            request_id.unbind(token)
