"""Request bodies read and validated straight from bytes, failing as FastAPI fails.

A body is validated by a ``TypeAdapter`` of the route's own schema model (the model FastAPI
documents the route with), in one pass from the JSON bytes. Schema errors come out as FastAPI
raises them (``RequestValidationError`` with locations under ``body``, ``HTTPException`` 400
for a body that cannot be decoded), so each protocol's error table renders them unchanged. A
body that is empty or not JSON is no schema error: it is 400 ``invalid_json`` on every route.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Receive

from ..errors import ApiError
from ..runtime import ClientDisconnected

T = TypeVar("T")


async def read_body(receive: Receive) -> bytes:
    """Every ``http.request`` message's bytes (the size limit is the middleware's: it raises
    413 from ``receive``)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def is_json_media_type(content_type: str | None) -> bool:
    """No header counts as JSON; otherwise application/json or any ``+json`` type."""
    if content_type is None:
        return True
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def require_json_media_type(content_type: str | None, *also: str) -> None:
    """415 ``unsupported_media_type`` for a body declared as something other than JSON (or
    one of the media types ``also``); no header counts as JSON."""
    if is_json_media_type(content_type):
        return
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type not in also:
        raise ApiError(
            415, "unsupported_media_type",
            f"content type {media_type!r} is not {' or '.join(('application/json', *also))}",
        )  # fmt: skip


def validation_errors(exc: ValidationError, *prefix: str | int) -> list[dict[str, Any]]:
    """pydantic's errors with their locations under ``prefix`` (e.g. ``"body"``)."""
    return [
        {**error, "loc": (*prefix, *error["loc"])}
        for error in exc.errors(include_url=False, include_context=True)
    ]


def parse_body(adapter: TypeAdapter[T], body: bytes, *, strict: bool | None = None) -> T:
    """Validate ``body`` with ``adapter`` (``strict``: as pydantic's, None for the model's
    own setting); raises ``ApiError`` 400 ``invalid_json`` (an empty body, or one that is
    not JSON), ``RequestValidationError`` (schema errors) or ``HTTPException`` 400
    (undecodable: not UTF-8, nested too deep)."""
    if not body:
        raise ApiError(400, "invalid_json", "request body is empty; send a JSON object")
    try:
        return adapter.validate_json(body, strict=strict)
    except ValidationError:
        pass
    # NOTE: a bad body is read again the framework's way (the standard library's JSON, then
    # validation of the Python value), so its errors read exactly as they always have: the
    # JSON-mode messages differ ("Input should be an object"), and the standard library
    # accepts a byte-order mark, UTF-16 and lone surrogates (refused later, as schema errors).
    # Only a bad body pays for the second pass.
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        raise ApiError(400, "invalid_json", "request body is not valid JSON") from None
    except Exception as exc:  # UnicodeDecodeError, RecursionError
        raise HTTPException(400, "There was an error parsing the body") from exc
    try:
        return adapter.validate_python(value, strict=strict, from_attributes=True)
    except ValidationError as exc:
        raise RequestValidationError(validation_errors(exc, "body")) from None
