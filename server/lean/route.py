"""A FastAPI route whose requests run a plain handler: the route's documentation stays
FastAPI's, the per-request path is ours."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import ApiError, to_api_error
from ..runtime import ClientDisconnected

LeanHandler = Callable[[Request], Awaitable[ASGIApp]]
"""Reads, validates and answers one request; returns the answer to send (an ASGI app)."""
ErrorRenderer = Callable[[Request, ApiError], Response]
ValidationMapper = Callable[[RequestValidationError], ApiError]


def lean_asgi(handler: LeanHandler, render: ErrorRenderer, validation: ValidationMapper) -> ASGIApp:
    """An ASGI app running ``handler``: every error ends as ``render``'s response, schema
    errors through ``validation``, and a client gone away as 499 (nothing is sent to it)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        answer: ASGIApp
        try:
            answer = await handler(request)
        except ClientDisconnected:
            scope.setdefault("state", {})["error_type"] = "client_disconnected"
            answer = Response(status_code=499)
        except RequestValidationError as exc:
            answer = _render(request, validation(exc), render)
        except Exception as exc:
            answer = _render(request, to_api_error(exc), render)  # logs what is not ours
        await answer(scope, receive, send)

    return app


def _render(request: Request, error: ApiError, render: ErrorRenderer) -> Response:
    request.scope.setdefault("state", {})["error_type"] = error.error_type
    return render(request, error)


def method_not_allowed(scope: Scope, methods: Collection[str], render: ErrorRenderer) -> Response:
    """405 ``method_not_allowed`` with ``Allow``, in ``render``'s shape (a protocol's own,
    where the framework would answer in ours)."""
    error = ApiError(405, "method_not_allowed", "Method Not Allowed")
    response = _render(Request(scope), error, render)
    response.headers["Allow"] = ", ".join(sorted(methods))
    return response


def lean_route(
    handler: LeanHandler, *, render: ErrorRenderer, validation: ValidationMapper
) -> type[APIRoute]:
    """A route class for ``add_api_route(route_class_override=...)``. FastAPI builds the
    route and its OpenAPI entry from the endpoint as usual, but never calls the endpoint:
    the route's requests run ``handler``, through ``lean_app``. ``LeanFront`` sends them
    there directly; where FastAPI's own router matches one (an app without the front), the
    route hands it over the same way."""

    class LeanRoute(APIRoute):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.lean_app = lean_asgi(handler, render, validation)

        async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["method"] in self.methods:
                await self.lean_app(scope, receive, send)
            else:
                await method_not_allowed(scope, self.methods, render)(scope, receive, send)

    return LeanRoute
