"""Request-level Prometheus metrics, on the registry the app was given."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from batching.metrics import LATENCY_BUCKETS_S, latency_buckets

REJECTION_REASONS = (
    "queue_full", "draining", "not_ready", "too_large", "invalid", "deadline", "unauthorized",
)  # fmt: skip


class ServerMetrics:
    """The request-level series. The hot path goes through the ``count_*`` and ``observe_*``
    methods, which resolve each labelled child once and keep it (``labels()`` takes a lock
    and builds a key on every call)."""

    def __init__(
        self, registry: CollectorRegistry, *, max_latency_s: float = LATENCY_BUCKETS_S[-1]
    ) -> None:
        self.requests = Counter(
            "batchfit_requests",
            "Finished HTTP requests by endpoint (/v1/infer, /v1/embeddings, /v1/models, the v2 "
            "infer path, or other), status code and error type.",
            ["endpoint", "code", "error_type"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "batchfit_request_duration_seconds",
            "End-to-end request latency inside the replica, by endpoint and model (empty for "
            "endpoints that run no model); buckets up to --max-timeout-s.",
            ["endpoint", "model"],
            buckets=latency_buckets(max_latency_s),
            registry=registry,
        )
        self.inputs = Counter(
            "batchfit_inputs", "Inputs answered successfully, by model.", ["model"],
            registry=registry,
        )  # fmt: skip
        self.input_tokens = Counter(
            "batchfit_input_tokens", "Tokens of inputs answered successfully, by model.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "batchfit_requests_in_flight", "Requests being handled now.", registry=registry
        )
        self.rejections = Counter(
            "batchfit_rejections",
            "Requests refused before or instead of compute, by reason: "
            + ", ".join(REJECTION_REASONS)
            + ".",
            ["reason"],
            registry=registry,
        )
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)
        self.ready = Gauge("batchfit_ready", "1 when the replica accepts work.", registry=registry)
        self.model_threads = Gauge(
            "batchfit_model_threads",
            "Intra-op threads the forward passes run on (CPU): every thread chosen, or 1 while "
            "other work holds the host's CPUs.",
            registry=registry,
        )
        self.draining = Gauge(
            "batchfit_draining", "1 while the replica drains before exit.", registry=registry
        )
        self.model = Info(
            "batchfit_model",
            "The models this replica serves, one series each: name, task, device and dtype.",
            ["model"],
            registry=registry,
        )
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def count_request(self, endpoint: str, status: int, error_type: str) -> None:
        self._child(self.requests, endpoint, str(status), error_type).inc()

    def observe_duration(self, endpoint: str, model: str, seconds: float) -> None:
        self._child(self.request_duration, endpoint, model).observe(seconds)

    def count_rejection(self, reason: str) -> None:
        self._child(self.rejections, reason).inc()

    def count_answered(self, model: str, num_inputs: int, num_tokens: int) -> None:
        self._child(self.inputs, model).inc(num_inputs)
        self._child(self.input_tokens, model).inc(num_tokens)
