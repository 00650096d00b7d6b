"""The ASGI guard that runs in front of Ray Serve's proxy (served: tests/integration)."""

from __future__ import annotations

import asyncio
import json

from api.proxy_guard import RejectNonUtf8Headers, bad_header, proxy_middlewares


def call(headers: list[tuple[bytes, bytes]]) -> tuple[list[dict], bool]:
    reached, sent = {"app": False}, []

    async def app(scope, receive, send):
        reached["app"] = True

    async def send(message):
        sent.append(message)

    guard = RejectNonUtf8Headers(app)
    asyncio.run(guard({"type": "http", "headers": headers}, None, send))
    return sent, reached["app"]


def test_a_value_that_is_not_utf8_gets_an_openai_400():
    sent, reached = call([(b"host", b"x"), (b"x-request-id", b"\xff\xfe\x80")])
    assert not reached
    start, body = sent
    assert start["status"] == 400 and (b"content-type", b"application/json") in start["headers"]
    doc = json.loads(body["body"])
    assert doc["error"]["code"] == "invalid_header" and "x-request-id" in doc["error"]["message"]
    assert (b"x-request-id", doc["request_id"].encode()) in start["headers"]


def test_good_headers_pass_through():
    sent, reached = call([(b"x-request-id", "é-1".encode()), (b"user-agent", b"curl")])
    assert reached and sent == []
    assert bad_header([(b"a", b"ok")]) is None


def test_the_proxy_callback_returns_starlette_middleware():
    (mw,) = proxy_middlewares()
    assert mw.cls is RejectNonUtf8Headers
