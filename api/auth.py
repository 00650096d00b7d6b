"""Optional bearer-token auth: ``Authorization: Bearer <key>``, compared in constant time.

One or more keys may be valid at once (key rotation). The token is compared with every
key by :func:`hmac.compare_digest`, without stopping at the first match, so the time taken
does not tell which key (or how much of one) matched. Keys and tokens are never logged
nor put in an error message.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from fastapi import Request

from api.errors import unauthorized


def key_matches(token: str, keys: Sequence[str]) -> bool:
    """Whether ``token`` equals one of ``keys`` (each compared in constant time)."""
    given = token.encode("utf-8", "surrogateescape")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode("utf-8"))
    return found


def check_api_key(request: Request, keys: str | Sequence[str] | None) -> None:
    """Raise a 401 ``APIError`` unless auth is off (no keys) or the request carries a key."""
    if isinstance(keys, str):
        keys = [keys]
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if not key_matches(token.strip(), keys):
        raise unauthorized("invalid API key")
