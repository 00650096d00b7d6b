"""Load over real HTTP: streaming chat completions through the ``openai`` client.

Every request is greedy, ignores EOS (so every answer is exactly ``max_tokens`` long and
the modes are compared on equal work) and asks for the token ids and usage. Timings are
the client's: TTFT is the arrival of the first chunk that carries text, ITL the gaps
between text chunks (a speculative round streams several tokens in one chunk), TPOT
``(e2e - TTFT) / (tokens - 1)``. ``run_level`` keeps ``concurrency`` requests in flight
(closed loop) until every prompt was sent once.
"""

from __future__ import annotations

import asyncio
import time
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


def make_client(base_url: str, api_key: str | None = None, timeout_s: float = 3600.0) -> Any:
    """An ``AsyncOpenAI`` client for ``base_url`` (the server root, without ``/v1``)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=base_url.rstrip("/") + "/v1",
        api_key=api_key or "none",
        max_retries=0,
        timeout=timeout_s,
    )


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
    t0 = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=DEFAULT_EXTRA if extra_body is None else extra_body,
        )
        async for chunk in stream:
            now = time.perf_counter() - t0
            if chunk.choices and chunk.choices[0].delta.content:
                rec.chunk_times_s.append(now)
                if rec.ttft_s is None:
                    rec.ttft_s = now
            extras = (chunk.model_extra or {}).get("longspark")
            if extras:
                rec.token_ids = extras.get("token_ids")
                rec.mode = extras.get("mode")
                rec.num_drafts = extras.get("num_drafts", 0)
                rec.num_draft_tokens = extras.get("num_draft_tokens", 0)
                rec.num_accepted_tokens = extras.get("num_accepted_tokens", 0)
            if chunk.usage is not None:
                rec.prompt_tokens = chunk.usage.prompt_tokens
                rec.output_tokens = chunk.usage.completion_tokens
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
