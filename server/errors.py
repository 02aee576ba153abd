"""Our typed errors become HTTP in one table, with one JSON error shape everywhere."""

from __future__ import annotations

import logging
import math

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from batching import DeadlineExceeded, InferenceFailed, OutOfMemory, QueueFull, ShuttingDown
from models import InputTooLong

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error with its HTTP status and ``error_type``, raised anywhere on the request path."""

    def __init__(
        self, status: int, error_type: str, message: str, *, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.retry_after_s = retry_after_s


def not_ready(message: str = "the model is not loaded and warmed up yet") -> ApiError:
    return ApiError(503, "not_ready", message, retry_after_s=1)


def model_not_found(name: str, served: list[str]) -> ApiError:
    return ApiError(
        404, "model_not_found",
        f"model {name!r} is not served here; this replica serves {', '.join(map(repr, served))}",
    )  # fmt: skip


def draining(message: str = "this replica is shutting down; retry on another") -> ApiError:
    return ApiError(503, "draining", message, retry_after_s=1)


# Errors the framework raises itself (routing, body parsing).
_HTTP_ERROR_TYPES = {
    400: "invalid_json",  # e.g. a body that is not UTF-8
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


def to_api_error(exc: BaseException) -> ApiError:
    """The table from our domain errors to HTTP."""
    match exc:
        case ApiError():
            return exc
        case QueueFull():
            return ApiError(429, "overloaded", str(exc), retry_after_s=exc.retry_after_s)
        case InputTooLong():
            return ApiError(413, "input_too_long", str(exc))
        case DeadlineExceeded():
            return ApiError(504, "deadline_exceeded", str(exc))
        case OutOfMemory():
            return ApiError(507, "out_of_memory", str(exc))
        case ShuttingDown():
            return ApiError(503, "draining", str(exc), retry_after_s=1)
        case InferenceFailed():
            return ApiError(500, "internal_error", str(exc))
        case StarletteHTTPException() if isinstance(exc.__cause__, UnicodeDecodeError):
            # FastAPI's own message for this ("There was an error parsing the body") says
            # nothing about the cause.
            return ApiError(400, "invalid_json", "body is not valid UTF-8")
        case StarletteHTTPException():
            error_type = _HTTP_ERROR_TYPES.get(exc.status_code, "http_error")
            return ApiError(exc.status_code, error_type, str(exc.detail))
        case _:
            # Not one of ours: a bug. Its traceback goes to the log, never to the client.
            log.error("unexpected error", exc_info=exc)
            return ApiError(500, "internal_error", "internal server error")


def request_id_of(request: Request) -> str:
    return getattr(request.state, "request_id", "")


def error_response(request: Request, error: ApiError) -> Response:
    request.state.error_type = error.error_type
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = {"error": error.message, "error_type": error.error_type}
    body["request_id"] = request_id_of(request)
    return Response(
        orjson.dumps(body), status_code=error.status, headers=headers, media_type="application/json"
    )


# Fields whose type is a union: pydantic reports one error per member of the union, which
# reads as noise; one sentence says what is accepted.
UNION_FIELD_MESSAGES = {"inputs": "inputs must be a string or a list of strings"}


def _describe_validation(exc: RequestValidationError) -> tuple[int, str, str]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "invalid_json", "request body is not valid JSON"
    parts: list[str] = []
    for error in errors:
        loc = tuple(error.get("loc", ()))
        field = loc[1] if len(loc) > 1 and loc[0] == "body" else None
        message = UNION_FIELD_MESSAGES.get(field) if error.get("type") != "missing" else None
        if message is not None:
            if message not in parts:
                parts.append(message)
            continue
        if len(parts) == 5:
            break
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{location}: {error.get('msg', 'invalid')}")
    return 422, "invalid_request", "; ".join(parts)


def validation_error(exc: RequestValidationError) -> ApiError:
    """The error for a schema error, FastAPI's or the lean path's (``server/lean``)."""
    return ApiError(*_describe_validation(exc))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(request, to_api_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return error_response(request, to_api_error(exc))  # logs what is not ours
