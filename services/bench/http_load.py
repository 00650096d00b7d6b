"""Load over real HTTP: streaming chat completions, one lean client for every server.

Every request is greedy, ignores EOS (so every answer is exactly ``max_tokens`` long and
the modes are compared on equal work) and asks for the token ids and usage. Timings are
the client's: TTFT is the arrival of the first chunk that carries text, ITL the gaps
between text chunks (a speculative round streams several tokens in one chunk), TPOT
``(e2e - TTFT) / (tokens - 1)``. ``run_level`` keeps ``concurrency`` requests in flight
(closed loop) until every prompt was sent once.

The client (:class:`StreamClient`) reads the server-sent events as lines and parses each
with ``json.loads``, as vLLM's own benchmark client does. It runs on the same cores as the
server it measures, so its cost is part of every measured token: the ``openai`` library
builds a pydantic model per chunk and took ~0.5 ms of CPU a token, this client ~0.2.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

Messages = list[dict[str, str]]
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


class StreamClient:
    """An OpenAI-API client for load: ``/v1/models`` and streamed chat completions, each
    event a dict. ``base_url`` is the server root, without ``/v1``."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 3600.0):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self._session: Any = None

    def _http(self) -> Any:
        import aiohttp

        if self._session is None:  # made inside the event loop that uses it
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=0),  # as many in flight as asked
                read_bufsize=1 << 20,  # a last event with every token id is one line
            )
        return self._session

    async def model(self) -> str:
        """The id of the first model the server lists."""
        async with self._http().get(self.base_url + "/v1/models") as resp:
            body = await resp.json(content_type=None)
            if resp.status != 200:
                raise StreamError(f"HTTP {resp.status}: {_message(body)}")
            return body["data"][0]["id"]

    async def stream_chat(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST ``body`` (with ``stream: true``) to ``/v1/chat/completions``; yields each
        event until ``[DONE]``. Raises :class:`StreamError` on a refusal (the error JSON's
        message) or an ``error`` event."""
        url = self.base_url + "/v1/chat/completions"
        async with self._http().post(url, json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                raise StreamError(f"HTTP {resp.status}: {_message(text)}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, keep-alives
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise StreamError(_message(event))
                yield event

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


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
