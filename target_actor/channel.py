"""The per-step pipe from the engine to each target rank: one authenticated socket per rank.

Ray starts, places and supervises the rank actors, and the engine sets each channel up
through a Ray call; the calls of every step then go over this socket instead of a Ray
task. On a 2-core host a Ray task costs ~2 ms around a 9 ms decode step (submission,
gRPC, the object store, the threads each wakes), and Ray's compiled graphs busy-wait on
their shared-memory channels, which takes a core from the forward pass. A blocking
socket read sleeps until the reply comes: ~0.1 ms a call, no core spent waiting.

The channel is also the rank watchdog: while a call runs the rank sends a heartbeat every
``HEARTBEAT_S``, so a rank that is slow (a long prompt) is told apart from one that is
stopped or hung, which falls silent; the engine gives up on it after ``silence_s``.

``multiprocessing.connection`` frames the messages and authenticates the peer with an
HMAC challenge on a key only the engine and the rank know (it came through Ray), so
nothing else on the host can make a rank run a call. Messages are pickled here, with a
tensor as its raw bytes (not ``Connection.send``'s pickler, which torch teaches to pass
tensors as shared-memory handles that only its own process family can open).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

import torch

from target_actor.errors import LongSparkError

log = logging.getLogger("longspark.channel")

HEARTBEAT_S = 0.5  # a rank at work says so this often
BEAT = b""  # a heartbeat frame (a reply is never empty)


class TargetLostError(LongSparkError, RuntimeError):
    """A rank's channel closed (its process died) or it did not answer in time: the target
    group cannot take another call."""


def new_key() -> bytes:
    return os.urandom(32)


def _tensor(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype, device="cpu")
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
            # a GPU rank's tensors leave through host memory: the one copy per message
            t = obj.detach().cpu().contiguous()
            empty = torch.empty(0, dtype=torch.uint8, device="cpu")
            raw = t.reshape(-1).view(torch.uint8) if t.numel() else empty
            return _tensor, (pickle.PickleBuffer(raw.numpy()), t.dtype, tuple(t.shape))
        return NotImplemented


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def serve(
    host: str,
    key: bytes,
    handle: Callable[[str, tuple[Any, ...]], Any],
    beat_s: float = HEARTBEAT_S,
) -> tuple[str, int]:
    """Listen on ``host`` (an ephemeral port) in a daemon thread for one engine; each
    message runs ``handle(method, args)`` and sends back ``(True, result)`` or
    ``(False, exception)``, with a heartbeat every ``beat_s`` while it runs. Returns the
    address to connect to."""
    listener = Listener((host, 0), authkey=key)
    thread = threading.Thread(target=_serve, args=(listener, handle, beat_s), daemon=True)
    thread.start()
    return listener.address


def _serve(
    listener: Listener, handle: Callable[[str, tuple[Any, ...]], Any], beat_s: float
) -> None:
    try:
        conn = listener.accept()
    except Exception:  # noqa: BLE001 - a peer without the key: no engine to serve
        log.exception("the target channel's engine did not connect")
        return
    finally:
        listener.close()
    sending, busy = threading.Lock(), threading.Event()
    beats = threading.Thread(target=_beat, args=(conn, sending, busy, beat_s), daemon=True)
    beats.start()
    with conn:
        while True:
            try:
                method, args = loads(conn.recv_bytes())
            except (EOFError, OSError):  # the engine closed the channel
                return
            busy.set()
            try:
                reply: tuple[bool, Any] = (True, handle(method, args))
            except Exception as exc:  # noqa: BLE001 - the engine decides what it means
                reply = (False, exc)
            finally:
                busy.clear()
            data = _encode(reply)
            with sending:
                conn.send_bytes(data)


def _beat(conn: Connection, sending: threading.Lock, busy: threading.Event, beat_s: float) -> None:
    """While a call runs, say so every ``beat_s``: a rank that is slow (a long prompt)
    keeps beating, a stopped or hung one falls silent."""
    while True:
        busy.wait()
        time.sleep(beat_s)
        with sending:
            if not busy.is_set():
                continue
            try:
                conn.send_bytes(BEAT)
            except OSError:
                return


def _encode(reply: tuple[bool, Any]) -> bytes:
    try:
        return dumps(reply)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # e.g. an exception
        return dumps((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]} ({exc})")))


class ChannelGroup:
    """The engine's end: the same call to every rank, rank 0's result back.

    ``silence_s`` is the watchdog: a rank that sends neither its answer nor a heartbeat
    for that long is taken for hung (``TargetLostError``), however long the call itself
    runs. None waits forever.
    """

    def __init__(
        self, addresses: list[tuple[str, int]], key: bytes, silence_s: float | None = None
    ) -> None:
        self.conns = [Client(tuple(a), authkey=key) for a in addresses]
        self.silence_s = silence_s
        self._lock = threading.Lock()  # one call in flight; the engine thread is the caller

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        """Run ``method(*args)`` on every rank. A rank's exception is raised as it was; a
        closed channel or a silent rank raises ``TargetLostError``."""
        with self._lock:
            try:
                data = dumps((method, args))
                for conn in self.conns:
                    conn.send_bytes(data)
                replies = self._replies()
            except (EOFError, OSError) as exc:
                raise TargetLostError(f"a target rank's channel closed: {exc!r}") from None
        for ok, value in replies:
            if not ok:
                raise value
        return replies[0][1]

    def _replies(self) -> list[tuple[bool, Any]]:
        """Every rank's reply, skipping heartbeats, watching each rank's silence together
        (rank 0 may beat while it waits in a collective for a hung rank 1)."""
        pending = dict(enumerate(self.conns))
        heard = dict.fromkeys(pending, time.monotonic())
        replies: dict[int, tuple[bool, Any]] = {}
        while pending:
            timeout = None
            if self.silence_s is not None:
                timeout = max(
                    0.0, min(heard[r] for r in pending) + self.silence_s - time.monotonic()
                )
            ready = set(wait(list(pending.values()), timeout))
            now = time.monotonic()
            for rank, conn in list(pending.items()):
                if conn in ready:
                    data = conn.recv_bytes()
                    heard[rank] = now
                    if data != BEAT:
                        replies[rank] = loads(data)
                        del pending[rank]
                elif self.silence_s is not None and now - heard[rank] >= self.silence_s:
                    raise TargetLostError(
                        f"target rank {rank} sent nothing for {self.silence_s:g} s (hung?)"
                    )
        return [replies[r] for r in range(len(self.conns))]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
