"""The status page's data: one sample a second, kept for the last few minutes in the replica.

Everything comes from what the replica already records: finished requests (observed from the
request middleware), the queue, and the batching and memory metrics on its registry. With
``--api-workers`` above 1 the engine keeps the one history: before each sample it asks every
API process for its requests since the last (``take``) and adds them in (``add``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from ..middleware import V2_INFER, RequestRecord

INFERENCE_ENDPOINTS = frozenset({"/v1/infer", "/v1/embeddings", "/v1/rerank", V2_INFER})
# Cumulative series whose increase over one interval makes a sample's figures.
_COUNTERS = {
    "batches": ("batchfit_batch_size_count", None),
    "batch_items": ("batchfit_batch_size_sum", None),
    "batch_tokens": ("batchfit_batch_tokens_sum", None),
    "oom_splits": ("batchfit_oom_events_total", ("outcome", "split")),
    "cache_hits": ("batchfit_cache_hits_total", None),
    "cache_misses": ("batchfit_cache_misses_total", None),
    "cache_bytes": ("batchfit_cache_bytes", None),  # a gauge, summed over the models
}
# Memory gauges, read as they are at the sample; null until the first batch has run (and a
# budget of 0 is no byte budget at all: the fixed sizer).
_GAUGES = {
    "memory_free_bytes": "batchfit_memory_free_bytes",
    "budget_bytes": "batchfit_batch_budget_bytes",
    "predicted_peak_bytes": "batchfit_batch_predicted_peak_bytes",
    "measured_peak_bytes": "batchfit_batch_measured_peak_bytes",
}
SAMPLE_FIELDS = (
    "t", "requests_per_s", "errors_per_s", "latency_p50_ms", "latency_p99_ms", "queue_depth",
    "batches", "batch_size", "padded_tokens", *_GAUGES, "oom_splits_total", "cache_hit_rate",
    "cache_bytes",
)  # fmt: skip


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def _read(registry: CollectorRegistry) -> dict[str, float]:
    """One pass over the registry for the few series a sample needs. With several models,
    counters add up over the models and a gauge reads the largest model's value."""
    wanted = {name for name, _ in _COUNTERS.values()} | set(_GAUGES.values())
    found: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name not in wanted:
                continue
            for key, (name, label) in _COUNTERS.items():
                if name == sample.name and (
                    label is None or sample.labels.get(label[0]) == label[1]
                ):
                    found[key] = found.get(key, 0.0) + sample.value
            for key, name in _GAUGES.items():
                if name == sample.name:
                    found[key] = max(found.get(key, sample.value), sample.value)
    return found


class StatusHistory:
    """A bounded ring buffer of per-interval samples, filled by ``sample`` (or ``run``)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        queue_depth: Callable[[], int],
        window_s: float,
        interval_s: float = 1.0,
    ) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError(f"need 0 < interval_s <= window_s, got {interval_s}, {window_s}")
        self.registry = registry
        self.queue_depth = queue_depth
        self.window_s = window_s
        self.interval_s = interval_s
        self.samples: deque[dict[str, Any]] = deque(maxlen=math.ceil(window_s / interval_s))
        self._requests = 0
        self._errors = 0
        self._latencies_s: list[float] = []
        self._last_counts: dict[str, float] = {}
        self._last_mono_s: float | None = None

    def observe(self, record: RequestRecord) -> None:
        """A request observer: inference requests count; latency is that of successes."""
        if record.endpoint not in INFERENCE_ENDPOINTS:
            return
        self._requests += 1
        if record.status >= 400:
            self._errors += 1
        else:
            self._latencies_s.append(record.duration_s)

    def take(self) -> tuple[int, int, list[float]]:
        """The requests observed here since the last take (count, errors, latencies of the
        successes), forgotten here: what an API process hands the engine's history."""
        tally = (self._requests, self._errors, self._latencies_s)
        self._requests = self._errors = 0
        self._latencies_s = []
        return tally

    def add(self, requests: int, errors: int, latencies_s: Sequence[float]) -> None:
        """Another process's ``take``, counted in the interval open now."""
        self._requests += requests
        self._errors += errors
        self._latencies_s.extend(latencies_s)

    def sample(self, wall_s: float, mono_s: float) -> dict[str, Any]:
        """Close the interval that ends now and append its sample."""
        elapsed = mono_s - self._last_mono_s if self._last_mono_s is not None else self.interval_s
        elapsed = max(elapsed, 1e-6)
        counts = _read(self.registry)
        delta = {k: counts.get(k, 0.0) - self._last_counts.get(k, 0.0) for k in _COUNTERS}
        latencies = sorted(self._latencies_s)
        batches = int(delta["batches"])
        sample: dict[str, Any] = {
            "t": round(wall_s, 3),
            "requests_per_s": round(self._requests / elapsed, 3),
            "errors_per_s": round(self._errors / elapsed, 3),
            "latency_p50_ms": _ms(percentile(latencies, 0.5)),
            "latency_p99_ms": _ms(percentile(latencies, 0.99)),
            "queue_depth": self.queue_depth(),
            "batches": batches,
            "batch_size": round(delta["batch_items"] / batches, 3) if batches else None,
            "padded_tokens": round(delta["batch_tokens"] / batches, 1) if batches else None,
            **_gauges(counts),
            "oom_splits_total": int(counts.get("oom_splits", 0)),
            "cache_hit_rate": _hit_rate(counts),
            "cache_bytes": int(counts.get("cache_bytes", 0)),
        }
        self.samples.append(sample)
        self._requests = self._errors = 0
        self._latencies_s = []
        self._last_counts = counts
        self._last_mono_s = mono_s
        return sample

    def since(self, t: float | None) -> list[dict[str, Any]]:
        """The samples newer than ``t`` (all of them when None)."""
        samples: Iterable[dict[str, Any]] = self.samples
        return [s for s in samples if t is None or s["t"] > t]

    async def run(self, before: Callable[[], Awaitable[None]] | None = None) -> None:
        """Sample every ``interval_s`` until cancelled (a slow loop skips, never bunches);
        ``before`` (the engine's gathering of its API processes' requests) is awaited ahead
        of each sample."""
        if before is not None:
            await before()
        self.sample(time.time(), time.monotonic())
        next_s = time.monotonic() + self.interval_s
        while True:
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))
            if before is not None:
                await before()
            now = time.monotonic()
            self.sample(time.time(), now)
            next_s = max(next_s + self.interval_s, now + self.interval_s / 2)


def _gauges(counts: dict[str, float]) -> dict[str, int | None]:
    if not counts.get("batches"):
        return dict.fromkeys(_GAUGES)
    gauges = {key: int(counts.get(key, 0)) for key in _GAUGES}
    gauges["budget_bytes"] = gauges["budget_bytes"] or None
    return gauges


def _hit_rate(counts: dict[str, float]) -> float | None:
    """Of every input looked up in the output cache since start, the share found there."""
    hits, misses = counts.get("cache_hits", 0.0), counts.get("cache_misses", 0.0)
    return round(hits / (hits + misses), 4) if hits + misses else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
