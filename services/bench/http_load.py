"""Load over real HTTP: streaming chat completions, one lean client for every server.

Every request is greedy, ignores EOS (so every answer is exactly ``max_tokens`` long and
the modes are compared on equal work) and asks for the token ids and usage. Timings are
the client's: TTFT is the arrival of the first chunk that carries text, ITL the gaps
between text chunks (a speculative round streams several tokens in one chunk), TPOT
``(e2e - TTFT) / (tokens - 1)``. ``run_level`` keeps ``concurrency`` requests in flight
(closed loop) until every prompt was sent once.

The client (:class:`StreamClient`) reads the server-sent events as lines and parses each
with ``json.loads``, as vLLM's own benchmark client does. It runs on the same cores as the
server it measures, so its cost is part of every measured token: it parses HTTP with
``httptools`` (llhttp) on its own small protocol and runs on ``uvloop``
(:func:`run_client`), where the ``openai`` library builds a pydantic model per chunk.
What is left a chunk is mostly the wake-up itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

Messages = list[dict[str, str]]
T = TypeVar("T")
DEFAULT_EXTRA = {"ignore_eos": True, "return_token_ids": True}


@dataclass
class RequestRecord:
    index: int  # the prompt's position in the level's prompt list
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)  # text chunks, from the send
    prompt_tokens: int = 0
    output_tokens: int = 0
    token_ids: list[int] | None = None
    mode: str | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]


class StreamError(RuntimeError):
    """The server refused a request, or reported an error inside its stream."""


class _Exchange(asyncio.Protocol):
    """One HTTP/1.1 request on its own connection, its response parsed by ``httptools``
    (llhttp, the parser uvicorn serves with): the status, then the body as complete lines
    (the event stream's) or whole (anything else)."""

    def __init__(self) -> None:
        import httptools

        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.lines: deque[bytes] = deque()
        self._partial = b""
        self.complete = False
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except Exception as exc:  # noqa: BLE001 - a malformed response: the reader raises it
            self.error = exc
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.complete and self.error is None:
            self.error = exc or ConnectionError("the server closed the connection mid-response")
        self._wake()

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        *whole, self._partial = (self._partial + body).split(b"\n")
        if whole:
            self.lines.extend(whole)
            self._wake()

    def on_message_complete(self) -> None:
        if self._partial:
            self.lines.append(self._partial)
            self._partial = b""
        self.complete = True
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def lines_until_done(self) -> AsyncIterator[bytes]:
        """Each body line as it arrives; raises the connection's or the parser's error."""
        while True:
            while self.lines:
                yield self.lines.popleft()
            if self.error is not None:
                raise self.error
            if self.complete:
                return
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None

    async def body(self) -> bytes:
        return b"\n".join([line async for line in self.lines_until_done()])


class StreamClient:
    """An OpenAI-API client for load: ``/v1/models`` and streamed chat completions, each
    event a dict. ``base_url`` is the server root (``http://`` or ``https://``), without
    ``/v1``. Each request opens its own connection (one TCP handshake a request, on a
    local server ~0.1 ms, against a stream of many tokens)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 3600.0):
        url = urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) server root: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._host, self._tls = url.hostname, url.scheme == "https"
        self._port = url.port or (443 if self._tls else 80)
        self._prefix = url.path
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._headers = f"Host: {url.netloc}\r\n{auth}Connection: close\r\n"
        self.timeout_s = timeout_s

    async def _send(self, method: str, path: str, body: bytes = b"") -> _Exchange:
        loop = asyncio.get_running_loop()
        _, exchange = await loop.create_connection(
            _Exchange, self._host, self._port, ssl=self._tls or None
        )
        head = f"{method} {self._prefix}{path} HTTP/1.1\r\n{self._headers}"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        assert exchange.transport is not None
        exchange.transport.write(head.encode() + b"\r\n" + body)
        return exchange

    async def model(self) -> str:
        """The id of the first model the server lists."""
        async with asyncio.timeout(self.timeout_s):
            exchange = await self._send("GET", "/v1/models")
            text = (await exchange.body()).decode()
        if exchange.status != 200:
            raise StreamError(f"HTTP {exchange.status}: {_message(text)}")
        return json.loads(text)["data"][0]["id"]

    async def stream_chat(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST ``body`` (with ``stream: true``) to ``/v1/chat/completions``; yields each
        event until ``[DONE]``. Raises :class:`StreamError` on a refusal (the error JSON's
        message) or an ``error`` event."""
        async with asyncio.timeout(self.timeout_s):
            exchange = await self._send("POST", "/v1/chat/completions", json.dumps(body).encode())
            try:
                lines = exchange.lines_until_done()
                async for line in lines:
                    if exchange.status != 200:
                        text = line + b"\n" + await exchange.body()
                        raise StreamError(f"HTTP {exchange.status}: {_message(text.decode())}")
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, keep-alives
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise StreamError(_message(event))
                    yield event
                if exchange.status != 200:
                    raise StreamError(f"HTTP {exchange.status}: (no body)")
            finally:
                if exchange.transport is not None:
                    exchange.transport.close()

    async def close(self) -> None:
        """Nothing to release: every request closes its own connection."""


def _message(body: Any) -> str:
    """An OpenAI error JSON's message (or the body itself, shortened)."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return body[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error or body)[:200]


def run_client(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` for the load's client, on ``uvloop`` where it is installed (its
    loop iteration, once a streamed chunk, costs a fraction of asyncio's own)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def make_client(base_url: str, api_key: str | None = None, timeout_s: float = 3600.0) -> Any:
    """The load client for the server at ``base_url`` (its root, without ``/v1``)."""
    return StreamClient(base_url, api_key, timeout_s)


async def send_one(
    client: Any,
    model: str,
    messages: Messages,
    max_tokens: int,
    index: int = 0,
    extra_body: dict[str, Any] | None = None,
) -> RequestRecord:
    """One streaming request. ``extra_body`` replaces the default extra fields (for a
    server that takes other ones). A server that sends no usage has its text chunks
    counted as tokens (one token per chunk, as such servers stream)."""
    rec = RequestRecord(index)
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(DEFAULT_EXTRA if extra_body is None else extra_body),
    }
    t0 = time.perf_counter()
    try:
        async for chunk in client.stream_chat(body):
            now = time.perf_counter() - t0
            choices = chunk.get("choices")
            if choices and (choices[0].get("delta") or {}).get("content"):
                rec.chunk_times_s.append(now)
                if rec.ttft_s is None:
                    rec.ttft_s = now
            extras = chunk.get("longspark")
            if extras:
                rec.token_ids = extras.get("token_ids")
                rec.mode = extras.get("mode")
                rec.num_drafts = extras.get("num_drafts", 0)
                rec.num_draft_tokens = extras.get("num_draft_tokens", 0)
                rec.num_accepted_tokens = extras.get("num_accepted_tokens", 0)
            usage = chunk.get("usage")
            if usage:
                rec.prompt_tokens = usage.get("prompt_tokens", 0)
                rec.output_tokens = usage.get("completion_tokens", 0)
        if rec.output_tokens == 0:
            rec.output_tokens = len(rec.chunk_times_s)
        rec.ok = rec.output_tokens > 0
        if not rec.ok:
            rec.error = "the stream ended without text or usage"
    except Exception as exc:  # noqa: BLE001 - recorded; the run reports failed requests
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.e2e_s = time.perf_counter() - t0
    return rec


async def run_level(
    client: Any,
    model: str,
    prompts: list[Messages],
    concurrency: int,
    max_tokens: int,
    extra_body: dict[str, Any] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Every prompt once, ``concurrency`` in flight; (records in prompt order, wall seconds)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    records: list[RequestRecord | None] = [None] * len(prompts)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            records[i] = await send_one(client, model, prompts[i], max_tokens, i, extra_body)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return [r for r in records if r is not None], time.perf_counter() - t0
