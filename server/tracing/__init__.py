"""OpenTelemetry traces of requests, sent over OTLP where ``--otlp-endpoint`` is set.

The app imports this package only then: without it, no OpenTelemetry SDK, exporter or span
is ever made. Each request's spans are built once it has been answered, from the times its
``RequestTrace`` recorded on the way (``spans.py``), so nothing on the request's path, the
batcher's or the model thread's knows about tracing."""

from __future__ import annotations

from .exporter import Tracing, traces_url
from .middleware import TracingMiddleware
from .spans import request_spans

__all__ = ["Tracing", "TracingMiddleware", "request_spans", "traces_url"]
