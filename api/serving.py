"""OpenAI completions and chat on top of an engine client: requests in, JSON or SSE out.

The engine client is anything with ``generate(GenerateRequest)`` (an async iterator of
``RequestOutput`` deltas; errors raise before the first one), ``stats()`` and ``health()``:
``services.engine.async_engine.AsyncEngine`` in-process, or the Serve deployment handle wrapped
by ``services.serving.app.ServeEngineClient``. Nothing here knows about Ray.

Streaming: the first delta is awaited before the response starts, so a request the
engine rejects gets a proper 4xx; after that, an error becomes an ``error`` event in the
stream. A client that goes away cancels the stream, which aborts the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from api.errors import not_found, sse_error
from api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    LongSparkInfo,
    ModelCard,
    ModelList,
    Usage,
    new_id,
    now,
)
from services.engine.async_engine import GenerateRequest
from services.engine.params import InvalidRequest, SamplingParams
from services.engine.sequence import RequestOutput, SpecStats


class EngineClient(Protocol):
    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    async def stats(self) -> dict[str, Any]: ...

    async def health(self) -> None: ...


@dataclass
class ServingSettings:
    model_name: str
    mode: str = "spec"  # reported in the `longspark` extras
    api_key: str | None = field(default=None, repr=False)  # one key; see ``keys``
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # more keys (rotation)
    max_request_bytes: int = 4 << 20
    completion_max_tokens: int = 16  # OpenAI's default for /v1/completions
    chat_max_tokens: int = 512  # when a chat request sets no max_tokens
    max_tokens_limit: int | None = None  # a request asking for more gets a 400
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers (browsers refuse)
    debug_routes: bool = True

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (empty: auth off)."""
        return tuple(k for k in (self.api_key, *self.api_keys) if k)


def _finish_reason(reason: str | None) -> str | None:
    return reason if reason in (None, "stop", "length") else "stop"


def _usage(final: RequestOutput) -> Usage:
    n = len(final.token_ids)
    return Usage(
        prompt_tokens=final.num_prompt_tokens,
        completion_tokens=n,
        total_tokens=final.num_prompt_tokens + n,
    )


async def _close(outputs: AsyncIterator[RequestOutput]) -> None:
    """Stop the engine stream (aborts the request if it is still running)."""
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        await aclose()
    elif hasattr(outputs, "cancel"):
        outputs.cancel()


class OpenAIServing:
    def __init__(self, client: EngineClient, settings: ServingSettings) -> None:
        self.client, self.settings = client, settings
        self.created = now()

    # -- models ---------------------------------------------------------------------
    def models(self) -> ModelList:
        return ModelList(data=[self.model_card(self.settings.model_name)])

    def model_card(self, name: str) -> ModelCard:
        self.check_model(name)
        return ModelCard(id=name, created=self.created)

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise not_found(
                f"the model {name!r} does not exist; this server serves "
                f"{self.settings.model_name!r}",
                "model",
            )

    def info(self, final: RequestOutput, token_ids: bool = False) -> LongSparkInfo:
        s = final.stats or SpecStats()
        return LongSparkInfo(
            token_ids=list(final.token_ids) if token_ids else None,
            mode=self.settings.mode,
            rounds=s.rounds,
            num_drafts=s.num_drafts,
            num_draft_tokens=s.num_draft_tokens,
            num_accepted_tokens=s.num_accepted_tokens,
            mean_accepted_length=round(s.mean_accepted_length, 3),
        )

    def sampling_params(
        self, req: CompletionRequest | ChatCompletionRequest, default_max_tokens: int
    ) -> SamplingParams:
        """The request's settings, ``max_tokens`` held to the server's cap."""
        limit = self.settings.max_tokens_limit
        if limit is not None:
            default_max_tokens = min(default_max_tokens, limit)
        params = req.sampling_params(default_max_tokens)
        if limit is not None and params.max_tokens > limit:
            raise InvalidRequest(f"max_tokens must be at most {limit} on this server", "max_tokens")
        return params

    # -- endpoints ------------------------------------------------------------------
    async def completions(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        params = self.sampling_params(req, self.settings.completion_max_tokens)
        greq = GenerateRequest(params, prompt=req.single_prompt(), request_id=new_id("cmpl"))
        outputs, first = await self._start(greq)
        if req.stream:
            return self._stream(greq.request_id, first, outputs, req, chat=False)
        final, text = await self._collect(first, outputs)
        return CompletionResponse(
            id=greq.request_id,
            created=now(),
            model=self.settings.model_name,
            choices=[
                CompletionChoice(text=text, finish_reason=_finish_reason(final.finish_reason))
            ],
            usage=_usage(final),
            longspark=self.info(final, bool(req.return_token_ids)),
        )

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        params = self.sampling_params(req, self.settings.chat_max_tokens)
        greq = GenerateRequest(
            params, messages=req.template_messages(), request_id=new_id("chatcmpl")
        )
        outputs, first = await self._start(greq)
        if req.stream:
            return self._stream(greq.request_id, first, outputs, req, chat=True)
        final, text = await self._collect(first, outputs)
        choice = ChatChoice(
            message=ChatMessageOut(content=text), finish_reason=_finish_reason(final.finish_reason)
        )
        return ChatCompletionResponse(
            id=greq.request_id,
            created=now(),
            model=self.settings.model_name,
            choices=[choice],
            usage=_usage(final),
            longspark=self.info(final, bool(req.return_token_ids)),
        )

    # -- the stream -----------------------------------------------------------------
    async def _start(
        self, greq: GenerateRequest
    ) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Submit and wait for the first delta: admission errors raise here."""
        outputs = self.client.generate(greq)
        try:
            first = await anext(outputs)
        except BaseException:
            await _close(outputs)
            raise
        return outputs, first

    async def _collect(
        self, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
    ) -> tuple[RequestOutput, str]:
        out, parts = first, [first.new_text]
        try:
            while not out.finished:
                out = await anext(outputs)
                parts.append(out.new_text)
        finally:
            if not out.finished:
                await _close(outputs)
        return out, "".join(parts)

    async def _stream(
        self,
        request_id: str,
        first: RequestOutput,
        outputs: AsyncIterator[RequestOutput],
        req: CompletionRequest | ChatCompletionRequest,
        chat: bool,
    ) -> AsyncIterator[str]:
        created, model = now(), self.settings.model_name

        def event(text: str | None, reason: str | None = None, out: RequestOutput | None = None):
            extras = self.info(out, bool(req.return_token_ids)) if out is not None else None
            if chat:
                delta = DeltaMessage(content=text) if text is not None else DeltaMessage()
                choice = ChatStreamChoice(delta=delta, finish_reason=reason)
                chunk = ChatCompletionChunk(
                    id=request_id, created=created, model=model, choices=[choice], longspark=extras
                )
            else:
                choice = CompletionChoice(text=text or "", finish_reason=reason)
                chunk = CompletionChunk(
                    id=request_id, created=created, model=model, choices=[choice], longspark=extras
                )
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        out = first
        try:
            if chat:
                role = ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))
                head = ChatCompletionChunk(
                    id=request_id, created=created, model=model, choices=[role]
                )
                yield f"data: {head.model_dump_json(exclude_none=True)}\n\n"
            while True:
                if out.finished:
                    yield event(out.new_text or None, _finish_reason(out.finish_reason), out)
                    break
                if out.new_text:
                    yield event(out.new_text)
                out = await anext(outputs)
            if req.include_usage:
                cls = ChatCompletionChunk if chat else CompletionChunk
                usage = cls(
                    id=request_id, created=created, model=model, choices=[], usage=_usage(out)
                )
                yield f"data: {usage.model_dump_json(exclude_none=True)}\n\n"
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-stream
            yield sse_error(exc)
        finally:
            if not out.finished:
                await _close(outputs)
        yield "data: [DONE]\n\n"
