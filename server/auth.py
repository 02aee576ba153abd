"""Optional API-key auth: ``Authorization: Bearer <key>``, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError, error_response

# Probes and scrapers carry no key; everything else (the API, its schema and docs) needs one.
OPEN_PATHS = frozenset({"/metrics"})
OPEN_PREFIXES = ("/health/", "/v2/health/")


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def key_matches(header: bytes | None, keys: Sequence[bytes]) -> bool:
    """Whether ``header`` is ``Bearer <one of keys>``; every key is compared in full."""
    if header is None:
        return False
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    token = token.strip()
    matched = False
    for key in keys:
        # NOTE: no early exit, so the time taken does not tell which key was close.
        matched |= hmac.compare_digest(token, key)
    return matched


class ApiKeyMiddleware:
    """401 with ``WWW-Authenticate: Bearer`` unless the request carries an accepted key."""

    def __init__(self, app: ASGIApp, *, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.app = app
        self.keys = tuple(key.encode() for key in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization")
        if key_matches(header, self.keys):
            await self.app(scope, receive, send)
            return
        message = "missing API key" if header is None else "invalid API key"
        error = ApiError(401, "unauthorized", message)
        await error_response(Request(scope), error)(scope, receive, send)
