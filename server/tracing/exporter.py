"""The tracer provider behind ``--otlp-endpoint``: spans batched and sent over OTLP/HTTP."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Tracer

SERVICE_NAME = "batchfit"
SCHEDULE_DELAY_MS = 200
"""How long a finished span may wait to be sent with others (the SDK's default is 5 s)."""
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
        self.provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        exporter = OTLPSpanExporter(endpoint=self.url, timeout=EXPORT_TIMEOUT_S)
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=SCHEDULE_DELAY_MS)
        )
        self.tracer: Tracer = self.provider.get_tracer("batchfit")

    def shutdown(self) -> None:
        """Send what is left and stop the exporter's thread (blocks up to the export
        timeout where the collector does not answer)."""
        self.provider.shutdown()
