"""The engine behind an asyncio server: one background thread owns the synchronous Engine.

The :class:`~services.engine.core.Engine` is not thread-safe, so exactly one thread, the
*engine thread*, ever touches it. asyncio callers talk to it through a thread-safe inbox
(admit a batch, abort, run a function between rounds) and read each request's outputs
from its own ``asyncio.Queue``, fed from the engine thread with
``loop.call_soon_threadsafe``. The thread sleeps on the inbox while nothing runs and
otherwise runs rounds back to back, draining the inbox between rounds, so an abort (a
client that went away) frees its sequence before the next round.

A failed round never kills the thread silently. The engine itself contains a round that
raises for some sequences (they alone finish with an error, which their streams get as
:class:`RequestFailed`); should ``step`` still raise, the requests it was running get the
error and are freed, and the engine keeps serving the others. If a target rank died (a ``RayActorError`` escapes the round; drafter
failures are absorbed by ``services.engine.resilient_drafter``), the engine is dead: every request
fails with :class:`EngineDeadError` and :meth:`AsyncEngine.check_health` raises, so Ray
Serve replaces the replica.

Limits (:class:`EngineLimits`) keep a busy replica from queueing without bound: a prompt
over ``max_prompt_tokens`` is refused (``TargetConfigError``), a request arriving while
``max_waiting`` requests already wait is refused (:class:`EngineOverloaded`), and one
still waiting for a running slot ``queue_timeout_s`` after it reached the server (its
``arrival_time``, stamped by the ingress) is dropped with :class:`QueueTimeout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from services.engine.core import Engine
from services.engine.errors import is_fatal, user_error_message
from services.engine.params import InvalidRequest, SamplingParams
from services.engine.sequence import RequestOutput, SeqStatus
from services.engine.tokenizer import Tokenizer
from target_actor.config import TargetConfigError
from target_actor.errors import LongSparkError
from target_actor.priority import raise_thread_priority

log = logging.getLogger("longspark.async_engine")


class EngineDeadError(LongSparkError, RuntimeError):
    """The engine lost a target rank; this replica cannot serve and will be replaced."""


class RequestFailed(LongSparkError, RuntimeError):
    """A round failed while running this request (the engine itself keeps serving)."""


class EngineOverloaded(LongSparkError, RuntimeError):
    """The waiting queue is full: the request is refused now (retry later)."""


class QueueTimeout(LongSparkError, RuntimeError):
    """The request waited for a running slot longer than the queue time-out."""


@dataclass
class EngineLimits:
    """What one engine takes at once; ``None`` = no limit."""

    max_prompt_tokens: int | None = None  # longer prompts are refused
    max_waiting: int | None = None  # requests waiting for a running slot, at most
    queue_timeout_s: float | None = None  # waiting longer (since arrival) fails the request

    def check_prompt(self, num_tokens: int) -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise TargetConfigError(
                f"the prompt has {num_tokens} tokens; this server accepts at most "
                f"{self.max_prompt_tokens}"
            )


@dataclass
class GenerateRequest:
    """One request for the engine: a raw prompt, token ids or chat messages, and sampling."""

    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # for the chat template (OpenAI's shape)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival_time: float = field(default_factory=time.time)  # wall clock: queue time-out

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", "prompt")


def encode_request(tok: Tokenizer, req: GenerateRequest) -> list[int]:
    """Prompt token ids: the chat template for messages, plain encoding for text."""
    if req.messages is not None:
        return tok.encode_chat(req.messages, req.tools)
    if isinstance(req.prompt, str):
        return tok.encode(req.prompt)
    return list(req.prompt)


class RequestStream:
    """One request's outputs, put by the engine thread and read by its asyncio task.

    ``interval`` (vLLM's ``stream_interval``): after the first delta, deltas are held and
    sent merged once they carry ``interval`` tokens, or when the request ends. Each delta
    sent costs a wake-up of the reader's loop and a message through the server; on a host
    whose cores run the forward, fewer of them leave the forward more of the CPU."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, interval: int = 1) -> None:
        self.request_id, self.loop, self.interval = request_id, loop, interval
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.closed = False  # set once the stream ended (finished, failed or abandoned)
        self._held: RequestOutput | None = None  # deltas not sent yet (engine thread)
        self._sent = False  # the first delta went out

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: hand ``item`` to the reader's loop (dropped once closed). A
        failure first sends what was held, so the reader has every token made before it."""
        if self.closed:
            return
        if isinstance(item, BaseException):
            self.closed = True
            if self._held is not None:
                self._send(self._held)
                self._held = None
            self._send(item)
            return
        if self._held is not None:
            item, self._held = merge_deltas(self._held, item), None
        if item.finished:
            self.closed = True
        elif self._sent and len(item.new_token_ids) < self.interval:
            self._held = item
            return
        self._sent = True
        self._send(item)

    def _send(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the reader's loop is gone
            self.closed = True


@dataclass
class _Admit:
    requests: list[tuple[list[int], GenerateRequest, RequestStream]]
    done: Future  # -> list[BaseException | None], one per request


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    done: Future


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """``a`` then ``b`` as one delta: new tokens and text joined, the rest from ``b``."""
    logprobs = None
    if a.new_logprobs is not None or b.new_logprobs is not None:
        logprobs = (a.new_logprobs or []) + (b.new_logprobs or [])
    return dataclasses.replace(
        b,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        new_text=a.new_text + b.new_text,
        new_logprobs=logprobs,
        prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs,
    )


class AsyncEngine:
    """An :class:`Engine` run by one background thread; asyncio-facing admit/stream/abort.

    ``generate`` is the whole client interface for one request (admit, then stream its
    ``RequestOutput`` deltas); a Serve deployment batches admissions itself with
    :meth:`admit` and reads each request with :meth:`stream`.
    """

    engine: Engine  # set by the engine thread before the constructor returns

    def __init__(
        self,
        engine: Engine | Callable[[], Engine],
        extra_stats: Callable[[], dict[str, Any]] | None = None,
        limits: EngineLimits | None = None,
        stream_interval: int = 1,
    ):
        """``engine``: the engine, or a function that builds it. A function is called on the
        engine thread, so a target that computes in this process (``LocalTarget``) makes its
        one OpenMP team, and takes its thread count and priority, on the thread that runs
        its rounds; its errors are raised here."""
        self.stream_interval = stream_interval  # a request may ask for more, not fewer
        self.limits = limits or EngineLimits()
        self._extra_stats = extra_stats
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._early_aborts: set[str] = set()  # engine thread only: aborted before admission
        self._deadlines: dict[str, float] = {}  # engine thread only: waiting -> time-out
        self.num_overloaded = self.num_queue_timeouts = 0
        self._dead: EngineDeadError | None = None
        self._stop = threading.Event()
        self.num_failed_rounds = 0
        built: Future[Engine] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(engine, built), name="longspark-engine", daemon=True
        )
        self._thread.start()
        built.result()  # self.engine is set by the engine thread; its build errors raise here
        self.tok: Tokenizer = self.engine.tok

    # -- asyncio side ---------------------------------------------------------------
    async def admit(self, requests: list[GenerateRequest]) -> list[RequestStream | BaseException]:
        """Tokenize and queue a batch in one engine-thread call; per request a stream or error."""
        loop = asyncio.get_running_loop()
        results: list[RequestStream | BaseException] = []
        batch = []
        for req in requests:
            try:
                ids = encode_request(self.tok, req)
                self.limits.check_prompt(len(ids))
            except Exception as exc:  # noqa: BLE001 - returned to that request alone
                results.append(exc)
                continue
            interval = max(self.stream_interval, req.params.stream_interval or 1)
            stream = RequestStream(req.request_id, loop, interval)
            batch.append((ids, req, stream))
            results.append(stream)
        if batch:
            try:
                errors = await asyncio.wrap_future(self._post(_Admit(batch, Future())))
            except asyncio.CancelledError:
                for _, req, _ in batch:
                    self.abort(req.request_id)
                raise
            failed = {id(s): e for (_, _, s), e in zip(batch, errors, strict=True) if e}
            results = [failed.get(id(r), r) for r in results]
        return results

    async def stream(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The request's output deltas until it finishes; abort it if the reader goes away.

        Deltas that queued up while the reader was busy go out merged into one, so a
        loaded replica sends fewer, larger messages instead of falling further behind."""
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                pending: BaseException | None = None
                while not item.finished and not stream.queue.empty():
                    nxt = stream.queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        pending = nxt
                        break
                    item = merge_deltas(item, nxt)
                finished = item.finished or pending is not None
                yield item
                if pending is not None:
                    raise pending
                if finished:
                    return
        finally:
            if not finished:  # cancelled (client disconnect) or closed early
                stream.closed = True
                self.abort(stream.request_id)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        (result,) = await self.admit([req])
        if isinstance(result, BaseException):
            raise result
        async for out in self.stream(result):
            yield out

    def abort(self, request_id: str) -> None:
        """Thread-safe; the sequence is freed before the engine's next round.

        An abort that arrives before its request was admitted (a caller cancelled while
        its admission batch was still filling) keeps the request from ever starting.
        """
        self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between rounds and return its result."""
        return await asyncio.wrap_future(self._post(_Call(fn, Future())))

    async def stats(self) -> dict[str, Any]:
        return await self.call(lambda engine: self._stats())

    async def tokenize(self, req: GenerateRequest, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids as a request would be given them (``/tokenize``)."""
        if isinstance(req.prompt, str) and not add_special_tokens:
            return self.tok.encode(req.prompt, add_special_tokens=False)
        return encode_request(self.tok, req)

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (``/detokenize``); ids outside the vocabulary are a 400."""
        vocab = self.engine.cfg.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequest("token id outside the vocabulary", "tokens")
        return self.tok.decode(token_ids)

    async def model_info(self) -> dict[str, Any]:
        """What ``/v1/models`` and ``/tokenize`` report about the served model."""
        return {"max_model_len": self.engine.max_len}

    async def health(self) -> None:
        self.check_health()

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread stopped")

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    def _post(self, cmd: _Admit | _Call) -> Future:
        if self._dead is not None:
            cmd.done.set_exception(self._dead)
        else:
            self._inbox.put(("cmd", cmd))
        return cmd.done

    # -- engine thread --------------------------------------------------------------
    def _run(self, engine: Engine | Callable[[], Engine], built: Future[Engine]) -> None:
        raise_thread_priority()  # on every round's critical path (target_actor.priority)
        try:
            if not isinstance(engine, Engine):
                engine = engine()
        except BaseException as exc:  # noqa: BLE001 - raised in the constructor
            built.set_exception(exc)
            return
        self.engine = engine
        built.set_result(engine)
        while not self._stop.is_set():
            busy = engine.has_unfinished() and self._dead is None
            self._drain(block=not busy)
            self._expire_waiting()
            if self._dead is not None or not engine.has_unfinished():
                continue
            try:
                engine.step()
            except Exception as exc:  # noqa: BLE001 - contain it, never die silently
                self._round_failed(exc)
        self._fail_all(EngineDeadError("the engine is shutting down"))

    def _drain(self, block: bool) -> None:
        try:
            items = [self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()]
        except queue.Empty:
            return
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for kind, payload in items:
            if kind == "abort":
                self._abort(payload)
            elif kind == "cmd":
                self._run_cmd(payload)

    def _run_cmd(self, cmd: _Admit | _Call) -> None:
        if self._dead is not None:
            cmd.done.set_exception(self._dead)
        elif isinstance(cmd, _Admit):
            cmd.done.set_result([self._add(ids, req, stream) for ids, req, stream in cmd.requests])
        else:
            try:
                cmd.done.set_result(cmd.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                cmd.done.set_exception(exc)

    def _add(self, ids: list[int], req: GenerateRequest, stream: RequestStream) -> Exception | None:
        def on_output(out: RequestOutput) -> None:
            # a request the engine failed alone: its stream gets the error, the rest go on
            stream.put(RequestFailed(out.error) if out.error else out)
            if out.finished:
                self._streams.pop(out.request_id, None)

        if req.request_id in self._early_aborts:
            self._early_aborts.discard(req.request_id)
            return RequestFailed("the request was cancelled before it started")
        limits = self.limits
        if (
            limits.max_waiting is not None
            and len(self.engine.scheduler.waiting) >= limits.max_waiting
        ):
            self.num_overloaded += 1
            return EngineOverloaded(
                f"the server is busy ({limits.max_waiting} requests already wait); retry later"
            )
        deadline = None
        if limits.queue_timeout_s is not None:
            deadline = req.arrival_time + limits.queue_timeout_s
            if time.time() > deadline:  # it spent its time in a queue in front of this one
                self.num_queue_timeouts += 1
                return self._queue_timeout()
        try:
            self.engine.add_request(ids, req.params, req.request_id, on_output)
        except Exception as exc:  # noqa: BLE001 - InvalidRequest, TargetConfigError...
            return exc
        self._streams[req.request_id] = stream
        if deadline is not None:
            self._deadlines[req.request_id] = deadline
        return None

    def _queue_timeout(self) -> QueueTimeout:
        return QueueTimeout(
            f"the request waited over {self.limits.queue_timeout_s:g}s for a slot; retry later"
        )

    def _expire_waiting(self) -> None:
        """Fail requests still waiting past their deadline (running ones are safe, and so
        are preempted ones: they were admitted once)."""
        if not self._deadlines:
            return
        now = time.time()
        for request_id, deadline in list(self._deadlines.items()):
            seq = self.engine.requests.get(request_id)
            if seq is None or seq.status is not SeqStatus.WAITING or seq.preemptions:
                del self._deadlines[request_id]
            elif now > deadline:
                del self._deadlines[request_id]
                self.num_queue_timeouts += 1
                log.warning("request %s timed out in the waiting queue", request_id)
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(self._queue_timeout())
                self.engine.abort(request_id)

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if request_id not in self.engine.requests:  # not admitted yet, or already finished
            if len(self._early_aborts) > 4096:
                self._early_aborts.clear()
            self._early_aborts.add(request_id)
            return
        try:
            self.engine.abort(request_id)
        except Exception as exc:  # noqa: BLE001
            self._round_failed(exc)

    def _round_failed(self, exc: Exception) -> None:
        """Fail what the round was running (all requests if a target rank died)."""
        self.num_failed_rounds += 1
        reason = user_error_message(exc)
        if is_fatal(exc):
            log.error("a target rank died; failing every request: %s", reason)
            self._dead = EngineDeadError(f"the model replica lost a target rank: {reason}")
            self._fail_all(self._dead)
            return
        log.exception("a round failed; failing its requests and serving on")
        for seq in list(self.engine.scheduler.running):
            stream = self._streams.pop(seq.request_id, None)
            if stream is not None:
                stream.put(RequestFailed(f"the engine failed on this request: {reason}"))
            try:
                self.engine.abort(seq.request_id)
            except Exception:  # noqa: BLE001 - freeing failed too: drop it from the engine
                log.exception("could not free %s", seq.request_id)
                self.engine.scheduler.finish(seq)
                self.engine.requests.pop(seq.request_id, None)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(exc)
        self._streams.clear()
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "cmd":
                payload.done.set_exception(exc)

    def _stats(self) -> dict[str, Any]:
        engine = self.engine
        out: dict[str, Any] = {
            "mode": engine.mode,
            "num_running": len(engine.scheduler.running),
            "num_waiting": len(engine.scheduler.waiting),
            "kv": engine.target.kv_stats(),
            "kv_reserved_tokens": engine.scheduler.reserved_tokens,
            "engine": engine.stats.summary(),
            "failed_rounds": self.num_failed_rounds,
            "overloaded": self.num_overloaded,
            "queue_timeouts": self.num_queue_timeouts,
            "drafter_states": None,
        }
        if engine.drafter is not None:
            out["drafter_states"] = engine.drafter.num_states()
        if self._extra_stats is not None:
            out.update(self._extra_stats())
        return out
