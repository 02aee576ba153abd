"""Optional API-key auth: ``Authorization: Bearer <key>``, compared in constant time.

Browser pages (the status page, the API docs) cannot send a bearer header, so there the key is
also accepted as the password of HTTP Basic auth (any user name), and a 401 asks the browser
for it. The protocols' routes (OpenAI's, KServe v2's) answer the 401 in their own error shape,
so their clients raise their usual errors."""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Sequence

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError, error_response
from .protocols.cohere_errors import COHERE_PATHS, cohere_error_response
from .protocols.kserve_v2 import v2_error_response
from .protocols.openai import openai_error_response

# Probes and scrapers carry no key; everything else (the API, its schema and docs) needs one.
OPEN_PATHS = frozenset({"/metrics"})
OPEN_PREFIXES = ("/health/", "/v2/health/")
# Pages a person opens in a browser: a 401 there asks for the key as a Basic password.
BROWSER_PREFIXES = ("/status", "/docs", "/redoc", "/openapi.json")


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def unauthorized(request: Request, error: ApiError) -> Response:
    """The 401 in the error shape of the route asked for: OpenAI's on ``/v1/embeddings``,
    Cohere's on ``/v2/embed`` and ``/v2/rerank``, KServe v2's elsewhere under ``/v2``, ours
    elsewhere; ``WWW-Authenticate: Bearer`` in each."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]  # as the routes see it under a root path
    if path == "/v1/embeddings":
        response = openai_error_response(request, error)
    elif path in COHERE_PATHS:
        response = cohere_error_response(request, error)
    elif path == "/v2" or path.startswith("/v2/"):
        response = v2_error_response(request, error)
    else:
        return error_response(request, error)
    request.state.error_type = error.error_type
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def _matches_any(token: bytes, keys: Sequence[bytes]) -> bool:
    matched = False
    for key in keys:
        # NOTE: no early exit, so the time taken does not tell which key was close.
        matched |= hmac.compare_digest(token, key)
    return matched


def key_matches(header: bytes | None, keys: Sequence[bytes]) -> bool:
    """Whether ``header`` is ``Bearer <one of keys>``; every key is compared in full."""
    if header is None:
        return False
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return _matches_any(token.strip(), keys)


def basic_key_matches(header: bytes | None, keys: Sequence[bytes]) -> bool:
    """Whether ``header`` is ``Basic base64(<any user>:<one of keys>)``."""
    if header is None:
        return False
    scheme, _, encoded = header.partition(b" ")
    if scheme.lower() != b"basic":
        return False
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    _, colon, password = decoded.partition(b":")
    return bool(colon) and _matches_any(password, keys)


class ApiKeyMiddleware:
    """401 unless the request carries an accepted key. Paths under ``exempt_prefixes`` guard
    themselves with a token of their own (the admin endpoints), so they are passed through."""

    def __init__(
        self, app: ASGIApp, *, keys: Sequence[str], exempt_prefixes: tuple[str, ...] = ()
    ) -> None:
        if not keys:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.app = app
        self.keys = tuple(key.encode() for key in keys)
        self.exempt_prefixes = exempt_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or is_open(path) or path.startswith(self.exempt_prefixes):
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization")
        browser = path.startswith(BROWSER_PREFIXES)
        if key_matches(header, self.keys) or (browser and basic_key_matches(header, self.keys)):
            await self.app(scope, receive, send)
            return
        message = "missing API key" if header is None else "invalid API key"
        error = ApiError(401, "unauthorized", message)
        response = unauthorized(Request(scope), error)
        if browser:
            response.headers["WWW-Authenticate"] = 'Basic realm="batchfit", charset="UTF-8"'
        await response(scope, receive, send)
