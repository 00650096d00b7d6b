"""Turning any failure into the one line a user sees (CLI) or an error class (API)."""

from __future__ import annotations


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's task/actor wrappers."""
    seen = 0
    while seen < 5 and getattr(exc, "cause", None) is not None and exc.cause is not exc:
        exc, seen = exc.cause, seen + 1
    return exc


def user_error_message(exc: BaseException) -> str:
    """One line: the domain message for expected errors, type and message otherwise."""
    from target_actor.config import TargetConfigError

    from .sampling import InvalidRequest

    exc = unwrap(exc)
    expected = (TargetConfigError, InvalidRequest, FileNotFoundError)
    try:
        from target_actor.checkpoint import ModelFetchError

        expected += (ModelFetchError,)
    except ImportError:  # pragma: no cover
        pass
    text = str(exc) if isinstance(exc, expected) else f"{type(exc).__name__}: {exc}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
