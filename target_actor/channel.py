"""The per-step pipe from the engine to each target rank: one authenticated socket per rank.

Ray starts, places and supervises the rank actors, and the engine sets each channel up
through a Ray call; the calls of every step then go over this socket instead of a Ray
task. On a 2-core host a Ray task costs ~2 ms around a 9 ms decode step (submission,
gRPC, the object store, the threads each wakes), and Ray's compiled graphs busy-wait on
their shared-memory channels, which takes a core from the forward pass. A blocking
socket read sleeps until the reply comes: ~0.1 ms a call, no core spent waiting.

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
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from target_actor.errors import LongSparkError

log = logging.getLogger("longspark.channel")

Call = tuple[str, tuple[Any, ...]]


class TargetLostError(LongSparkError, RuntimeError):
    """A rank's channel closed (its process died) or it did not answer in time: the target
    group cannot take another call."""


def new_key() -> bytes:
    return os.urandom(32)


def _tensor(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
            t = obj.detach().cpu().contiguous()
            raw = (
                t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            )
            return _tensor, (pickle.PickleBuffer(raw.numpy()), t.dtype, tuple(t.shape))
        return NotImplemented


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def serve(host: str, key: bytes, handle: Callable[[str, tuple[Any, ...]], Any]) -> tuple[str, int]:
    """Listen on ``host`` (an ephemeral port) in a daemon thread for one engine; each
    message runs ``handle(method, args)`` and sends back ``(True, result)`` or
    ``(False, exception)``. Returns the address to connect to."""
    listener = Listener((host, 0), authkey=key)
    thread = threading.Thread(target=_serve, args=(listener, handle), daemon=True)
    thread.start()
    return listener.address


def _serve(listener: Listener, handle: Callable[[str, tuple[Any, ...]], Any]) -> None:
    try:
        conn = listener.accept()
    except Exception:  # noqa: BLE001 - a peer without the key: no engine to serve
        log.exception("the target channel's engine did not connect")
        return
    finally:
        listener.close()
    with conn:
        while True:
            try:
                method, args = loads(conn.recv_bytes())
            except (EOFError, OSError):  # the engine closed the channel
                return
            try:
                reply: tuple[bool, Any] = (True, handle(method, args))
            except Exception as exc:  # noqa: BLE001 - the engine decides what it means
                reply = (False, exc)
            _send(conn, reply)


def _send(conn: Connection, reply: tuple[bool, Any]) -> None:
    try:
        data = dumps(reply)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # e.g. an exception
        data = dumps((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]} ({exc})")))
    conn.send_bytes(data)


class ChannelGroup:
    """The engine's end: the same call to every rank, rank 0's result back."""

    def __init__(self, addresses: list[tuple[str, int]], key: bytes) -> None:
        self.conns = [Client(tuple(a), authkey=key) for a in addresses]
        self._lock = threading.Lock()  # one call in flight; the engine thread is the caller

    def call(self, method: str, args: tuple[Any, ...], timeout_s: float | None = None) -> Any:
        """Run ``method(*args)`` on every rank. A rank's exception is raised as it was; a
        closed channel or no answer within ``timeout_s`` raises ``TargetLostError``."""
        with self._lock:
            try:
                data = dumps((method, args))
                for conn in self.conns:
                    conn.send_bytes(data)
                replies = []
                for rank, conn in enumerate(self.conns):
                    if timeout_s is not None and not conn.poll(timeout_s):
                        raise TargetLostError(f"target rank {rank} did not answer in {timeout_s} s")
                    replies.append(loads(conn.recv_bytes()))
            except (EOFError, OSError) as exc:
                raise TargetLostError(f"a target rank's channel closed: {exc!r}") from None
        for ok, value in replies:
            if not ok:
                raise value
        return replies[0][1]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
