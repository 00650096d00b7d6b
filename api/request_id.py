"""One request id per HTTP request: taken from ``X-Request-Id`` or made up, echoed, logged.

The id lives in a context variable for the request's task (and the tasks it starts), so
error bodies (``api.errors``) and log lines of the ``longspark.*`` loggers carry it
without passing it around. Under Ray Serve the proxy has already put an ``x-request-id``
on the request (the client's, or one it generated), so the ids agree with Serve's logs.
"""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar, Token

HEADER = "x-request-id"
MAX_LEN = 200

_current: ContextVar[str | None] = ContextVar("longspark_request_id", default=None)


def choose(header_value: str | None) -> str:
    """The client's id when it is short printable ASCII, otherwise a fresh one."""
    if header_value and len(header_value) <= MAX_LEN and header_value.isprintable():
        if header_value.isascii():
            return header_value
    return uuid.uuid4().hex


def current() -> str | None:
    return _current.get()


def bind(request_id: str | None) -> Token:
    return _current.set(request_id)


def unbind(token: Token) -> None:
    _current.reset(token)


class RequestIdFilter(logging.Filter):
    """Prefix a record with ``[request <id>]`` when it is logged inside a request."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = _current.get()
        record.request_id = rid or "-"
        if rid and not getattr(record, "_longspark_rid", False):
            record.msg = f"[request {rid}] {record.msg}"
            record._longspark_rid = True
        return True


LOGGERS = (
    "longspark.api",
    "longspark.serve",
    "longspark.async_engine",
    "longspark.drafter_faults",
    "longspark.engine",
)


def install_log_filter(names: tuple[str, ...] = LOGGERS) -> None:
    """Tag the records of our loggers (a logger's filters do not reach its children)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RequestIdFilter) for f in logger.filters):
            logger.addFilter(RequestIdFilter())
