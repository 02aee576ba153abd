"""The ASGI middleware that traces each API request (outermost: it sees every answer)."""

from __future__ import annotations

import logging
import time
from typing import Any

from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .spans import RequestTimes, request_spans

log = logging.getLogger("batchfit")

UNTRACED_PREFIXES = ("/health/", "/metrics", "/status", "/docs", "/redoc", "/openapi.json")
"""Probes, scrapes and pages: no request of the API."""
_PROPAGATED = (b"traceparent", b"tracestate")


class TracingMiddleware:
    def __init__(self, app: ASGIApp, *, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer
        self.propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path.startswith(UNTRACED_PREFIXES):
            await self.app(scope, receive, send)
            return
        start_ns, start_s = time.time_ns(), time.perf_counter()
        state: dict[str, Any] = scope.setdefault("state", {})
        status = 500
        response_start_s: float | None = None
        response_end_s: float | None = None

        async def timed_send(message: Message) -> None:
            nonlocal status, response_start_s, response_end_s
            if message["type"] == "http.response.start":
                status, response_start_s = message["status"], time.perf_counter()
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                response_end_s = time.perf_counter()

        try:
            await self.app(scope, receive, timed_send)
        finally:
            times = RequestTimes(
                start_ns, start_s, time.perf_counter(), response_start_s, response_end_s
            )
            try:
                self._send_spans(scope, state, status, times)
            except Exception:  # a span never costs a request its answer
                log.exception("could not record the trace spans of a request")

    def _send_spans(
        self, scope: Scope, state: dict[str, Any], status: int, times: RequestTimes
    ) -> None:
        carrier = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in scope.get("headers", ())
            if key in _PROPAGATED
        }
        method, path = scope.get("method", ""), scope["path"]
        request_spans(
            self.tracer, name=f"{method} {_route(path)}", parent=self.propagator.extract(carrier),
            times=times, status=status, method=method, path=path, state=state,
        )  # fmt: skip


def _route(path: str) -> str:
    """A span name of low cardinality: a path that names a model, as its template."""
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return "/v2/models/{name}/infer"
    if path.startswith("/v1/models/"):
        return "/v1/models/{name}"
    return path
