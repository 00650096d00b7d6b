"""Optional bearer-token auth: ``Authorization: Bearer <key>``, compared in constant time."""

from __future__ import annotations

import hmac

from fastapi import Request

from .errors import unauthorized


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raise a 401 ``APIError`` unless auth is off or the request carries the key."""
    if not api_key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise unauthorized("invalid API key")
