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

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from api.errors import not_found, sse_error
from api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCallOut,
    LongSparkInfo,
    ModelCard,
    ModelList,
    PromptLogprob,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallOut,
    TopLogprob,
    Usage,
    new_id,
    now,
)
from services.engine import tools
from services.engine.async_engine import GenerateRequest
from services.engine.params import InvalidRequest, SamplingParams
from services.engine.sequence import OutputLogprob, RequestOutput, SpecStats


class EngineClient(Protocol):
    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    async def stats(self) -> dict[str, Any]: ...

    async def health(self) -> None: ...

    async def tokenize(self, request: GenerateRequest, add_special_tokens: bool) -> list[int]: ...

    async def detokenize(self, token_ids: list[int]) -> str: ...

    async def model_info(self) -> dict[str, Any]: ...


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
    # what a request that sets no sampling fields gets (the model's generation config)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (empty: auth off)."""
        return tuple(k for k in (self.api_key, *self.api_keys) if k)


def _finish_reason(reason: str | None) -> str | None:
    return reason if reason in (None, "stop", "length") else "stop"


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
        self._max_model_len: int | None = None

    # -- models ---------------------------------------------------------------------
    async def models(self) -> ModelList:
        return ModelList(data=[await self.model_card(self.settings.model_name)])

    async def model_card(self, name: str) -> ModelCard:
        self.check_model(name)
        if self._max_model_len is None:
            self._max_model_len = (await self.client.model_info()).get("max_model_len")
        return ModelCard(
            id=name, created=self.created, root=name, max_model_len=self._max_model_len
        )

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
        """The request's settings (unset ones from the model's generation config),
        ``max_tokens`` held to the server's cap."""
        limit = self.settings.max_tokens_limit
        if limit is not None:
            default_max_tokens = min(default_max_tokens, limit)
        params = req.sampling_params(default_max_tokens, self.settings.sampling_defaults)
        if limit is not None and params.max_tokens > limit:
            raise InvalidRequest(f"max_tokens must be at most {limit} on this server", "max_tokens")
        return params

    # -- endpoints ------------------------------------------------------------------
    async def completions(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        params = self.sampling_params(req, self.settings.completion_max_tokens)
        request_id = new_id("cmpl")
        prompts = req.prompts()
        greqs = [
            GenerateRequest(p, prompt=prompt, request_id=f"{request_id}-{i}")
            for i, (prompt, p) in enumerate(
                (prompt, p) for prompt in prompts for p in _choice_params(params, req.num_choices)
            )
        ]
        echoes = [""] * len(greqs)
        if req.echo:
            texts = [q if isinstance(q, str) else await self.client.detokenize(q) for q in prompts]
            echoes = [t for t in texts for _ in range(req.num_choices)]
        streams = await self._start(greqs)
        choices = _Choices(greqs, req.num_choices, echoes)
        if req.stream:
            return self._stream(request_id, streams, choices, req, chat=False)
        finals = await self._collect(streams, choices)
        return CompletionResponse(
            id=request_id,
            created=now(),
            model=self.settings.model_name,
            choices=[
                CompletionChoice(
                    index=i,
                    text=choices.text[i],
                    logprobs=_completion_logprobs(
                        (choices.prompt_logprobs[i] if req.echo else []) + choices.logprobs[i],
                        0 if req.echo else len(echoes[i]),
                    )
                    if params.logprobs is not None
                    else None,
                    finish_reason=_finish_reason(f.finish_reason),
                    prompt_logprobs=_prompt_logprobs(choices.prompt_logprobs[i])
                    if req.prompt_logprobs is not None
                    else None,
                )
                for i, f in enumerate(finals)
            ],
            usage=choices.usage(finals),
            longspark=self.info(finals[0], bool(req.return_token_ids)),
        )

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        params = self.sampling_params(req, self.settings.chat_max_tokens)
        request_id = new_id("chatcmpl")
        messages, tool_list = req.template_messages(), req.tool_dicts()
        greqs = [
            GenerateRequest(p, messages=messages, tools=tool_list, request_id=f"{request_id}-{i}")
            for i, p in enumerate(_choice_params(params, req.num_choices))
        ]
        streams = await self._start(greqs)
        choices = _Choices(greqs, req.num_choices)
        if req.stream:
            return self._stream(request_id, streams, choices, req, chat=True)
        finals = await self._collect(streams, choices)
        answers = [_ToolOutput(req).parse(text) for text in choices.text]
        return ChatCompletionResponse(
            id=request_id,
            created=now(),
            model=self.settings.model_name,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatMessageOut(
                        content=content,
                        tool_calls=[
                            ToolCallOut(
                                id=c.id,
                                function=FunctionCallOut(name=c.name, arguments=c.arguments),
                            )
                            for c in calls
                        ],
                    ),
                    logprobs=_chat_logprobs(choices.logprobs[i])
                    if params.logprobs is not None
                    else None,
                    finish_reason=_ToolOutput(req).finish_reason(f.finish_reason, bool(calls)),
                )
                for i, (f, (content, calls)) in enumerate(zip(finals, answers, strict=True))
            ],
            usage=choices.usage(finals),
            longspark=self.info(finals[0], bool(req.return_token_ids)),
            prompt_logprobs=_prompt_logprobs(choices.prompt_logprobs[0])
            if req.prompt_logprobs is not None
            else None,
        )

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model or self.settings.model_name)
        messages = req.template_messages()
        greq = GenerateRequest(
            SamplingParams(), prompt=req.prompt, messages=messages, tools=req.tool_dicts()
        )
        ids = await self.client.tokenize(greq, req.add_special_tokens is not False)
        info = await self.client.model_info()
        return TokenizeResponse(count=len(ids), max_model_len=info.get("max_model_len"), tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model or self.settings.model_name)
        return DetokenizeResponse(prompt=await self.client.detokenize(req.tokens))

    # -- the streams ----------------------------------------------------------------
    async def _start(
        self, greqs: list[GenerateRequest]
    ) -> list[tuple[AsyncIterator[RequestOutput], RequestOutput]]:
        """Submit every choice and wait for each one's first delta: admission errors raise
        here (and the choices already started are stopped)."""

        async def start(greq: GenerateRequest):
            outputs = self.client.generate(greq)
            try:
                return outputs, await anext(outputs)
            except BaseException:
                await _close(outputs)
                raise

        started = await asyncio.gather(*(start(g) for g in greqs), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(
                *(_close(r[0]) for r in started if not isinstance(r, BaseException)),
                return_exceptions=True,
            )
            raise failed[0]
        return started  # type: ignore[return-value]

    async def _collect(
        self,
        streams: list[tuple[AsyncIterator[RequestOutput], RequestOutput]],
        choices: _Choices,
    ) -> list[RequestOutput]:
        """Every choice's whole answer; its final outputs, in choice order."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, out in _merged(streams):
            choices.add(index, out)
            if out.finished:
                finals[index] = out
        return finals  # type: ignore[return-value]

    async def _stream(
        self,
        request_id: str,
        streams: list[tuple[AsyncIterator[RequestOutput], RequestOutput]],
        choices: _Choices,
        req: CompletionRequest | ChatCompletionRequest,
        chat: bool,
    ) -> AsyncIterator[str]:
        created, model = now(), self.settings.model_name
        want_logprobs = req.num_logprobs() is not None

        def event(
            index: int,
            text: str | DeltaMessage | None,
            reason: str | None = None,
            out: RequestOutput | None = None,
            logprobs: list[OutputLogprob] | None = None,
            offset: int = 0,
        ) -> str:
            extras = self.info(out, bool(req.return_token_ids)) if out is not None else None
            if chat:
                assert not isinstance(text, str)
                delta = text or DeltaMessage()
                choice = ChatStreamChoice(
                    index=index,
                    delta=delta,
                    finish_reason=reason,
                    logprobs=_chat_logprobs(logprobs) if want_logprobs and logprobs else None,
                )
                chunk = ChatCompletionChunk(
                    id=request_id, created=created, model=model, choices=[choice], longspark=extras
                )
            else:
                assert not isinstance(text, DeltaMessage)
                choice = CompletionChoice(
                    index=index,
                    text=text or "",
                    finish_reason=reason,
                    logprobs=_completion_logprobs(logprobs, offset)
                    if want_logprobs and logprobs
                    else None,
                )
                chunk = CompletionChunk(
                    id=request_id, created=created, model=model, choices=[choice], longspark=extras
                )
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        finals: list[RequestOutput | None] = [None] * len(streams)
        tool_outputs = [_ToolOutput(req) for _ in streams] if chat else []
        try:
            for index in range(len(streams)):
                if chat:
                    role = ChatStreamChoice(
                        index=index, delta=DeltaMessage(role="assistant", content="")
                    )
                    head = ChatCompletionChunk(
                        id=request_id, created=created, model=model, choices=[role]
                    )
                    yield f"data: {head.model_dump_json(exclude_none=True)}\n\n"
                elif choices.echo[index]:
                    first = streams[index][1]  # its prompt's log-probabilities, if asked
                    echo_lps = first.prompt_logprobs if want_logprobs else None
                    yield event(index, choices.echo[index], logprobs=echo_lps, offset=0)
            async for index, out in _merged(streams):
                offset = choices.offset(index)
                choices.add(index, out)
                if chat:
                    if out.finished:
                        finals[index] = out
                    last = out if out.finished and len(streams) == 1 else None
                    lp = out.new_logprobs if want_logprobs else None
                    for delta, reason in tool_outputs[index].deltas(out, bool(lp)):
                        yield event(index, delta, reason, last if reason else None, lp)
                        lp = None
                    continue
                if out.finished:
                    finals[index] = out
                    reason = _finish_reason(out.finish_reason)
                    last = out if len(streams) == 1 else None
                    yield event(index, out.new_text or None, reason, last, out.new_logprobs, offset)
                elif out.new_text or (want_logprobs and out.new_logprobs):
                    yield event(index, out.new_text, None, None, out.new_logprobs, offset)
            if req.include_usage:
                cls = ChatCompletionChunk if chat else CompletionChunk
                usage = cls(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=choices.usage(finals),  # type: ignore[arg-type]
                )
                yield f"data: {usage.model_dump_json(exclude_none=True)}\n\n"
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-stream
            yield sse_error(exc)
        finally:
            await asyncio.gather(
                *(_close(o) for (o, _), f in zip(streams, finals, strict=True) if f is None),
                return_exceptions=True,
            )
        yield "data: [DONE]\n\n"


def _choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One request's settings per choice: a seeded request's choice ``i`` takes seed
    ``seed + i`` (as vLLM does), so the choices differ and the request stays reproducible."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


class _ToolOutput:
    """One chat choice's text as OpenAI returns it under the request's ``tool_choice``:
    plain content (none), text and Hermes calls (auto), the array of calls the grammar
    held it to (required), or one function's arguments (named); whole or as stream deltas."""

    def __init__(self, req: ChatCompletionRequest) -> None:
        self.mode = req.tool_mode if req.tools else "none"
        self.name = req.named_tool()["function"]["name"] if self.mode == "named" else ""
        self._hermes = tools.HermesStream()
        self._text = ""  # required: the array so far
        self._calls = 0  # calls streamed so far
        self._named_id = ""

    def parse(self, text: str) -> tuple[str | None, list[tools.ToolCall]]:
        if self.mode == "auto":
            return tools.parse_hermes(text)
        if self.mode == "required":
            return None, tools.parse_required(text)
        if self.mode == "named":
            return None, [tools.ToolCall(self.name, text)]
        return text, []

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """``tool_calls`` when the model chose to call (auto, required); a named call
        finishes with ``stop``, as OpenAI's does."""
        reason = _finish_reason(reason)
        if called and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def deltas(self, out: RequestOutput, carry: bool) -> list[tuple[DeltaMessage, str | None]]:
        """The chunks for one engine delta, each with its finish reason (set on the last
        chunk of a finished choice); ``carry``: send a chunk even if empty (logprobs)."""
        text, parts = out.new_text, []
        if self.mode == "none":
            parts = [DeltaMessage(content=text)] if text else []
        elif self.mode == "auto":
            items = self._hermes.feed(text) if text else []
            parts = [
                self._piece(i) for i in items + (self._hermes.finish() if out.finished else [])
            ]
        elif self.mode == "named":
            if text or (out.finished and not self._named_id):
                call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))
                if not self._named_id:  # the first chunk names the call
                    self._named_id = tools.ToolCall(self.name, "").id
                    call.id, call.type, call.function.name = self._named_id, "function", self.name
                parts = [DeltaMessage(tool_calls=[call])]
        else:  # required: the array is parsed whole when it is complete
            self._text += text
            if out.finished:
                parts = [self._piece(c) for c in tools.parse_required(self._text)]
        if not out.finished:
            return [(p, None) for p in parts or ([DeltaMessage()] if carry else [])]
        parts = parts or [DeltaMessage()]
        reason = self.finish_reason(out.finish_reason, self._calls > 0)
        return [(p, None) for p in parts[:-1]] + [(parts[-1], reason)]

    def _piece(self, item: str | tools.ToolCall) -> DeltaMessage:
        if isinstance(item, str):
            return DeltaMessage(content=item)
        index, self._calls = self._calls, self._calls + 1
        function = DeltaFunctionCall(name=item.name, arguments=item.arguments)
        return DeltaMessage(
            tool_calls=[DeltaToolCall(index=index, id=item.id, type="function", function=function)]
        )


class _Choices:
    """What a request's choices have produced so far: text and log-probabilities."""

    def __init__(self, greqs: list[GenerateRequest], n: int, echo: list[str] | None = None):
        self.n = n
        self.echo = echo or [""] * len(greqs)
        self.text = list(self.echo)
        self.logprobs: list[list[OutputLogprob]] = [[] for _ in greqs]
        self.prompt_logprobs: list[list[OutputLogprob]] = [[] for _ in greqs]
        self._chars = [len(e) for e in self.echo]  # characters the tokens so far spell

    def add(self, index: int, out: RequestOutput) -> None:
        self.text[index] += out.new_text
        if out.prompt_logprobs:
            self.prompt_logprobs[index] = out.prompt_logprobs
        if out.new_logprobs:
            self.logprobs[index].extend(out.new_logprobs)
            self._chars[index] += sum(len(e.token) for e in out.new_logprobs)

    def offset(self, index: int) -> int:
        """Where the choice's next token starts in its text (as its tokens spell it; the
        text itself may lag behind, held back for stop strings or split characters)."""
        return self._chars[index]

    def usage(self, finals: list[RequestOutput]) -> Usage:
        """Prompt tokens once per prompt (its n choices share it), every choice's output."""
        prompt = sum(f.num_prompt_tokens for f in finals[:: self.n])
        completion = sum(len(f.token_ids) for f in finals)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


async def _merged(
    streams: list[tuple[AsyncIterator[RequestOutput], RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every choice's deltas as they come, each with its choice index (its first delta,
    already read, first)."""
    if len(streams) == 1:  # the usual case: no tasks
        outputs, out = streams[0]
        yield 0, out
        while not out.finished:
            out = await anext(outputs)
            yield 0, out
        return
    inbox: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(index: int, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in outputs:
                await inbox.put((index, out))
                if out.finished:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            await inbox.put((index, exc))

    for index, (_, first) in enumerate(streams):
        await inbox.put((index, first))
    tasks = [
        asyncio.create_task(pump(i, o))
        for i, (o, first) in enumerate(streams)
        if not first.finished
    ]
    try:
        left = len(streams)
        while left:
            index, item = await inbox.get()
            if isinstance(item, BaseException):
                raise item
            left -= item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _completion_logprobs(entries: list[OutputLogprob], offset: int) -> CompletionLogprobs:
    """The completions shape: ``top_logprobs`` holds the chosen token and the top N."""
    out = CompletionLogprobs()
    for e in entries:
        out.text_offset.append(offset)
        offset += len(e.token)
        out.tokens.append(e.token)
        out.token_logprobs.append(e.logprob)
        if e.logprob is None:  # the prompt's first token: nothing to condition on
            out.top_logprobs.append(None)
            continue
        top = {e.token: e.logprob}
        top.update({t: v for t, _, v in e.top if t not in top})
        out.top_logprobs.append(top)
    return out


def _prompt_logprobs(entries: list[OutputLogprob]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, token id -> its log-probability, rank
    and text, for the token itself and the most likely ones there."""
    out: list[dict[str, PromptLogprob] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        place = {
            str(e.token_id): PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=e.token)
        }
        for rank, (text, token_id, value) in enumerate(e.top, start=1):
            place.setdefault(
                str(token_id), PromptLogprob(logprob=value, rank=rank, decoded_token=text)
            )
        out.append(place)
    return out


def _chat_logprobs(entries: list[OutputLogprob]) -> ChatLogprobs:
    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **item(e.token, e.logprob),
                top_logprobs=[TopLogprob(**item(t, v)) for t, _, v in e.top],
            )
            for e in entries
        ]
    )
