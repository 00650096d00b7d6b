"""A guard in front of Ray Serve's HTTP proxy: header values that are not UTF-8 get a 400.

Ray Serve's proxy (2.60) decodes some request headers itself before the app runs:
``x-request-id``, ``x-session-id``, ``serve_multiplexed_model_id``,
``x-request-timeout-seconds``, ``x-request-disconnect-disabled`` (``ray/serve/_private/
proxy.py`` and ``http_util.py``, a bare ``value.decode()``). Raw bytes there raise
``UnicodeDecodeError`` inside the proxy, and uvicorn answers a bare ``text/plain`` 500.
The only hook that runs before that decode is the proxy's middleware callback, named by
the environment variable ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (its list wraps
the proxy's ASGI app; ``HTTPOptions.middlewares`` was removed). ``longspark serve`` sets
it to :func:`proxy_middlewares` (:func:`install`) before it starts Ray; with ``serve run``
or a cluster, export it where the proxies start (``deploy/README.md``).

The guard answers the OpenAI error JSON of ``api.errors`` (code ``invalid_header``). It
is plain ASGI on purpose: the proxy process imports it, so it must not pull in the model
or FastAPI.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

ENV_VAR = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
IMPORT_PATH = "api.proxy_guard:proxy_middlewares"


def install() -> None:
    """Name the guard for the Serve proxies that Ray processes started after this will
    run (they inherit the environment); a value already set is kept."""
    os.environ.setdefault(ENV_VAR, IMPORT_PATH)


def bad_header(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The name of the first header whose value is not UTF-8, or None."""
    for name, value in headers:
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return name.decode("latin-1")
    return None


def error_body(header: str, request_id: str) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": f"the {header} header is not valid UTF-8",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_header",
            },
            "request_id": request_id,
        }
    ).encode()


class RejectNonUtf8Headers:
    """ASGI middleware: a 400 JSON error for a request with a header value that is not
    UTF-8, before anything downstream decodes it; every other request passes as it is."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        header = bad_header(scope.get("headers") or []) if scope["type"] == "http" else None
        if header is None:
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        body = error_body(header, request_id)
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", request_id.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list:
    """The proxy's middleware callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    from starlette.middleware import Middleware

    return [Middleware(RejectNonUtf8Headers)]
