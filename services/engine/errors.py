"""Turning any failure into the one line a user sees (CLI) or an error class (API)."""

from __future__ import annotations

from target_actor.channel import TargetLostError
from target_actor.config import TargetConfigError
from target_actor.errors import LongSparkError

__all__ = ["LongSparkError", "TargetConfigError", "is_fatal", "unwrap", "user_error_message"]


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's task/actor wrappers."""
    seen = 0
    while seen < 5 and getattr(exc, "cause", None) is not None and exc.cause is not exc:
        exc, seen = exc.cause, seen + 1
    return exc


def is_fatal(exc: BaseException) -> bool:
    """A failure no retry of the round can contain: a Ray actor (a target rank) died, or a
    rank's channel closed or did not answer (the group cannot take another call)."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    lost = (RayActorError, TargetLostError)
    return isinstance(exc, lost) or isinstance(unwrap(exc), lost)


def user_error_message(exc: BaseException) -> str:
    """One line: a ``LongSparkError``'s message as is (written for users), type + message
    for anything else (a missing file's message already names it)."""
    exc = unwrap(exc)
    plain = isinstance(exc, (LongSparkError, FileNotFoundError))
    text = str(exc) if plain else f"{type(exc).__name__}: {exc}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
