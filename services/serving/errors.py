"""Ray Serve's exceptions as OpenAI errors: the translator ``api.errors`` runs first.

``api`` never imports Ray Serve, so the mapping of Serve's own failures lives here and is
added when the serving app is built (``services.serving.app`` imports this module).
"""

from __future__ import annotations

from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from api.errors import APIError, add_translator, busy, unavailable
from services.engine.errors import unwrap


def translate(exc: BaseException) -> APIError | None:
    if isinstance(exc, BackPressureError):  # Serve's queue in front of the engine is full
        return busy("the server is busy; retry later")
    cause = unwrap(exc)
    if isinstance(cause, DeploymentUnavailableError):
        return unavailable(str(cause), "replica_unavailable")
    return None


add_translator(translate)
