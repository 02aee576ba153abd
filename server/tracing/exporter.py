"""The tracer provider behind ``--otlp-endpoint``: spans batched and sent over OTLP/HTTP."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Tracer

SERVICE_NAME = "batchfit"
SCHEDULE_DELAY_MS = 200
"""How long a finished span may wait to be sent with others (the SDK's default is 5 s;
``OTEL_BSP_SCHEDULE_DELAY``, the SDK's own variable, still sets it)."""
SCHEDULE_DELAY_VARIABLE = "OTEL_BSP_SCHEDULE_DELAY"
EXPORT_TIMEOUT_S = 5.0
TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """Where spans are posted: ``endpoint`` as given where it has a path, else the
    collector's OTLP/HTTP traces path under it (as ``OTEL_EXPORTER_OTLP_ENDPOINT`` is read)."""
    parts = urlsplit(endpoint)
    if parts.path.strip("/"):
        return endpoint
    return urlunsplit(parts._replace(path=TRACES_PATH))


class Tracing:
    """One process's tracer and exporter. Its own provider, never the global one: FastAPI
    and other libraries would otherwise send spans of their own through it."""

    def __init__(self, endpoint: str) -> None:
        self.url = traces_url(endpoint)
        # The app's lifespan shuts it down (``shutdown``), not an exit hook of the SDK's.
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": SERVICE_NAME}), shutdown_on_exit=False
        )
        exporter = OTLPSpanExporter(endpoint=self.url, timeout=EXPORT_TIMEOUT_S)
        # NOTE: None lets the SDK read its variable; a value given here would override it.
        delay_ms = None if SCHEDULE_DELAY_VARIABLE in os.environ else SCHEDULE_DELAY_MS
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=delay_ms)
        )
        self.tracer: Tracer = self.provider.get_tracer("batchfit")

    def shutdown(self) -> None:
        """Send what is left and stop the exporter's thread (blocks up to the export
        timeout where the collector does not answer)."""
        self.provider.shutdown()
