"""Prometheus metrics of the batching layer, on a registry passed in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip


def powers_of_two(maximum: int) -> tuple[float, ...]:
    """1, 2, 4, ... up to and including ``maximum`` (for batch sizes and tokens)."""
    buckets = []
    value = 1
    while value < maximum:
        buckets.append(float(value))
        value *= 2
    buckets.append(float(maximum))
    return tuple(buckets)


class BatchingMetrics:
    def __init__(self, registry: CollectorRegistry, *, max_batch_size: int, max_batch_tokens: int):
        self.queue_depth = Gauge(
            "batchfit_queue_depth", "Items waiting in the queue.", registry=registry
        )
        self.queue_capacity = Gauge(
            "batchfit_queue_capacity", "Most items the queue admits.", registry=registry
        )
        self.queue_wait = Histogram(
            "batchfit_queue_wait_seconds",
            "Time an item waited from admission to the start of its batch.",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.batch_size = Histogram(
            "batchfit_batch_size",
            "Items per forward pass.",
            buckets=powers_of_two(max_batch_size),
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "batchfit_batch_tokens",
            "Padded tokens (items x longest) per forward pass.",
            buckets=powers_of_two(max_batch_tokens),
            registry=registry,
        )
        self.batch_duration = Histogram(
            "batchfit_batch_duration_seconds",
            "Wall time of one forward pass on the model thread.",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.real_tokens = Counter(
            "batchfit_batch_real_tokens",
            "Real (unpadded) tokens run through the model.",
            registry=registry,
        )
        self.padded_tokens = Counter(
            "batchfit_batch_padded_tokens",
            "Padded tokens run through the model; divide by real tokens for the padding ratio.",
            registry=registry,
        )
        self.batch_failures = Counter(
            "batchfit_batch_failures",
            "Forward passes that failed for a reason other than memory.",
            registry=registry,
        )
        self.cancelled = Counter(
            "batchfit_cancelled_items",
            "Items whose request went away, by the stage they were in.",
            ["stage"],
            registry=registry,
        )
        for stage in ("queued", "running"):
            self.cancelled.labels(stage)
        self.budget_items = Gauge(
            "batchfit_batch_budget_items", "Item budget of the next batch.", registry=registry
        )
        self.budget_tokens = Gauge(
            "batchfit_batch_budget_tokens",
            "Padded-token budget of the next batch.",
            registry=registry,
        )
