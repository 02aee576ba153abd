"""The status page's data: one sample a second, kept for the last few minutes in the replica.

Everything comes from what the replica already records: finished requests (observed from the
request middleware), the queue, and the batching, memory and generation metrics on its
registry. With ``--api-workers`` above 1 the engine keeps the one history: before each sample
it asks every API process for its requests since the last (``take``) and adds them in
(``add``).
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

INFERENCE_ENDPOINTS = frozenset({
    "/v1/infer", "/v1/embeddings", "/v1/rerank", V2_INFER, "/v1/completions",
    "/v1/chat/completions", "/embed_sparse", "/v2/rerank", "/v2/embed", "/tokenize",
    "/detokenize",
})  # fmt: skip
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
# The generators' series (null while the replica serves none): token counters read as rates,
# gauges added up over the models but the budget (every model's is read from the same free
# memory: the largest), and latency histograms read as percentiles over the whole window.
_GENERATION_COUNTERS = {
    "generated_tokens": "batchfit_generation_generated_tokens_total",
    "prompt_tokens": "batchfit_generation_prompt_tokens_total",
}
_GENERATION_GAUGES = {
    "running_sequences": "batchfit_generation_running_sequences",
    "waiting_sequences": "batchfit_generation_waiting_sequences",
    "kv_cache_bytes": "batchfit_generation_cache_bytes",
}
_GENERATION_BUDGET = "batchfit_generation_cache_budget_bytes"
_GENERATION_HISTOGRAMS = {
    "ttft": "batchfit_generation_time_to_first_token_seconds_bucket",
    "tbt": "batchfit_generation_time_between_tokens_seconds_bucket",
}
GENERATION_FIELDS = (
    "generated_tokens_per_s", "prompt_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
    "tbt_p50_ms", "tbt_p99_ms", *_GENERATION_GAUGES, "kv_cache_budget_bytes",
)  # fmt: skip
SAMPLE_FIELDS = (
    "t", "requests_per_s", "errors_per_s", "latency_p50_ms", "latency_p99_ms", "queue_depth",
    "batches", "batch_size", "padded_tokens", *_GAUGES, "oom_splits_total", "cache_hit_rate",
    "cache_bytes", *GENERATION_FIELDS,
)  # fmt: skip
Buckets = dict[float, float]
"""A histogram's cumulative counts by upper bound (``le``), ``inf`` included."""


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def histogram_percentile(buckets: Buckets, q: float) -> float | None:
    """The ``q`` quantile of the observations counted in ``buckets``, interpolated linearly
    inside the bucket it falls in, as Prometheus's ``histogram_quantile`` does (the lowest
    bucket starts at 0; in the ``inf`` bucket, the highest finite bound); None without
    observations. O(buckets)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _read(registry: CollectorRegistry) -> tuple[dict[str, float], dict[str, Buckets]]:
    """One pass over the registry for the few series a sample needs. With several models,
    counters add up over the models and a gauge reads the largest model's value (but the
    generation gauges, which add up); histogram buckets add up over the models."""
    generation_sums = {**_GENERATION_COUNTERS, **_GENERATION_GAUGES}
    wanted = {name for name, _ in _COUNTERS.values()} | set(_GAUGES.values())
    wanted |= {*generation_sums.values(), _GENERATION_BUDGET, *_GENERATION_HISTOGRAMS.values()}
    found: dict[str, float] = {}
    buckets: dict[str, Buckets] = {}
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
            for key, name in generation_sums.items():
                if name == sample.name:
                    found[key] = found.get(key, 0.0) + sample.value
            if sample.name == _GENERATION_BUDGET:
                found["kv_cache_budget_bytes"] = max(
                    found.get("kv_cache_budget_bytes", 0.0), sample.value
                )
            for key, name in _GENERATION_HISTOGRAMS.items():
                if name == sample.name:
                    le = float(sample.labels["le"])
                    counts = buckets.setdefault(key, {})
                    counts[le] = counts.get(le, 0.0) + sample.value
    return found, buckets


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
        # The histograms' buckets as they were at each of the window's samples, and one more:
        # the window's start, which the percentiles of its latest sample count from.
        self._window_buckets: deque[dict[str, Buckets]] = deque(
            maxlen=(self.samples.maxlen or 0) + 1
        )

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
        counts, buckets = _read(self.registry)
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
            **self._generation(counts, buckets, elapsed),
        }
        self.samples.append(sample)
        self._requests = self._errors = 0
        self._latencies_s = []
        self._last_counts = counts
        self._last_mono_s = mono_s
        return sample

    def _generation(
        self, counts: dict[str, float], buckets: dict[str, Buckets], elapsed_s: float
    ) -> dict[str, float | int | None]:
        """The generation figures of the interval that ends now; null without a generator
        (its series appear once one is loaded)."""
        self._window_buckets.append(buckets)
        if not buckets:
            return dict.fromkeys(GENERATION_FIELDS)
        figures: dict[str, float | int | None] = {
            f"{key}_per_s": round(
                (counts.get(key, 0.0) - self._last_counts.get(key, 0.0)) / elapsed_s, 3
            )
            for key in _GENERATION_COUNTERS
        }
        # Over the window: from its start, or from the history's first sample until then.
        full = len(self._window_buckets) == self._window_buckets.maxlen
        start = self._window_buckets[0] if full else {}
        for key in _GENERATION_HISTOGRAMS:
            now, then = buckets.get(key, {}), start.get(key, {})
            window = {le: count - then.get(le, 0.0) for le, count in now.items()}
            for q in (0.5, 0.99):
                figures[f"{key}_p{round(q * 100)}_ms"] = _ms(histogram_percentile(window, q))
        for key in (*_GENERATION_GAUGES, "kv_cache_budget_bytes"):
            figures[key] = int(counts.get(key, 0))
        return figures

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
