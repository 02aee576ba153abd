"""Request bodies read and validated straight from bytes, failing as FastAPI fails.

A body is validated by a ``TypeAdapter`` of the route's own schema model (the model FastAPI
documents the route with), in one pass from the JSON bytes. Errors come out as FastAPI
raises them (``RequestValidationError`` with locations under ``body``, ``HTTPException`` 400
for a body that cannot be decoded), so each protocol's error table renders them unchanged.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Receive

from ..runtime import ClientDisconnected

T = TypeVar("T")

_MISSING_BODY = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}


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


def validation_errors(exc: ValidationError, *prefix: str | int) -> list[dict[str, Any]]:
    """pydantic's errors with their locations under ``prefix`` (e.g. ``"body"``)."""
    return [
        {**error, "loc": (*prefix, *error["loc"])}
        for error in exc.errors(include_url=False, include_context=True)
    ]


def parse_body(adapter: TypeAdapter[T], body: bytes, *, declared_json: bool = True) -> T:
    """Validate ``body`` with ``adapter``; raises ``RequestValidationError`` (schema errors,
    invalid JSON) or ``HTTPException`` 400 (undecodable: not UTF-8, nested too deep). A body
    declared as something other than JSON (``declared_json`` false) is not parsed: it fails
    validation as the bytes it is, as in FastAPI."""
    if not body:
        raise RequestValidationError([_MISSING_BODY])
    if not declared_json:
        try:
            return adapter.validate_python(body, from_attributes=True)
        except ValidationError as exc:
            raise RequestValidationError(validation_errors(exc, "body")) from None
    try:
        return adapter.validate_json(body)
    except ValidationError:
        pass
    # NOTE: a bad body is read again the framework's way (the standard library's JSON, then
    # validation of the Python value), so its errors read exactly as they always have: the
    # JSON-mode messages differ ("Input should be an object"), and the standard library
    # accepts a byte-order mark and UTF-16. Only a bad body pays for the second pass.
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error"}
        raise RequestValidationError([{**error, "input": {}, "ctx": {"error": exc.msg}}]) from None
    except Exception as exc:  # UnicodeDecodeError, RecursionError
        raise HTTPException(400, "There was an error parsing the body") from exc
    try:
        return adapter.validate_python(value, from_attributes=True)  # as FastAPI validates
    except ValidationError as exc:
        raise RequestValidationError(validation_errors(exc, "body")) from None
