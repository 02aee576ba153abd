"""The app's outermost ASGI layer: POSTs to the lean routes go straight to their handlers.

FastAPI builds its middleware stack once, at the first request; ``install_lean_front`` puts
``LeanFront`` around what it builds. A POST whose path is a lean route's runs through
``wrap`` (the same request-context and API-key middleware the rest of the app has, as pure
ASGI) to that route's handler; everything else, and other methods on those paths, goes on to
FastAPI's stack as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send


class LeanFront:
    def __init__(
        self, fallback: ASGIApp, routes: Sequence[Any], wrap: Callable[[ASGIApp], ASGIApp]
    ) -> None:
        self.fallback = fallback
        self._exact = {r.path: r for r in routes if not r.param_convertors}
        self._patterned = [r for r in routes if r.param_convertors]  # in registration order
        self._prefixes = tuple(r.path.split("{", 1)[0] for r in self._patterned)
        self._stack = wrap(self._dispatch)

    def match(self, scope: Scope) -> BaseRoute | None:
        """The lean route a POST to this path runs (path parameters set in ``scope``)."""
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]  # as Starlette's routing reads it under a root path
        route = self._exact.get(path)
        if route is not None or not path.startswith(self._prefixes):
            return route
        for candidate in self._patterned:
            match, child_scope = candidate.matches(scope)
            if match == Match.FULL:
                scope.update(child_scope)
                return candidate
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.match(scope)
            if route is not None:
                scope["route"] = route
                await self._stack(scope, receive, send)
                return
        await self.fallback(scope, receive, send)

    @staticmethod
    async def _dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        await scope["route"].lean_app(scope, receive, send)


def install_lean_front(
    app: FastAPI, routes: Sequence[Any], wrap: Callable[[ASGIApp], ASGIApp]
) -> None:
    """Serve ``routes`` (routes made by ``lean_route``) through a ``LeanFront`` in ``app``."""
    build = app.build_middleware_stack

    def build_with_front() -> ASGIApp:
        return LeanFront(build(), routes, wrap)

    # NOTE: Starlette calls build_middleware_stack() once, at the first request (or
    # lifespan event), and stores the result; an instance attribute shadows the method.
    app.build_middleware_stack = build_with_front  # type: ignore[method-assign]
