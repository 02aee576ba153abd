"""A route class that answers errors in a protocol's own error shape instead of ours."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.responses import Response

from ..errors import ApiError, to_api_error
from ..inference import ClientDisconnected

ErrorRenderer = Callable[[Request, ApiError], Response]
Handler = Callable[[Request], Awaitable[Response]]


def protocol_route(render: ErrorRenderer, validation_status: int) -> type[APIRoute]:
    """An ``APIRoute`` whose errors (ours, schema errors and unexpected ones) are rendered by
    ``render``; schema errors get ``validation_status``."""

    class ProtocolRoute(APIRoute):
        def get_route_handler(self) -> Handler:
            handler = super().get_route_handler()

            async def handle(request: Request) -> Response:
                try:
                    return await handler(request)
                except ClientDisconnected:
                    return Response(status_code=499)
                except RequestValidationError as exc:
                    error = protocol_validation(validation_status)(exc)
                except Exception as exc:
                    error = to_api_error(exc)  # logs what is not ours
                request.state.error_type = error.error_type
                return render(request, error)

            return handle

    return ProtocolRoute


def protocol_validation(status: int) -> Callable[[RequestValidationError], ApiError]:
    """Schema errors as a protocol answers them: ``status``, ``invalid_request``."""

    def validation(exc: RequestValidationError) -> ApiError:
        return ApiError(status, "invalid_request", describe(exc.errors()))

    return validation


def describe(errors: Sequence[Any]) -> str:
    """A short message from pydantic's error list (FastAPI's or a ValidationError's)."""
    parts = []
    for error in list(errors)[:5]:
        if error.get("type") == "json_invalid":
            return "request body is not valid JSON"
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{location}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def describe_pydantic(exc: ValidationError) -> str:
    return describe(exc.errors())


def retry_headers(error: ApiError) -> dict[str, str]:
    if error.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, int(-(-error.retry_after_s // 1))))}
