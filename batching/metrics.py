"""Prometheus metrics of the batching layer, on a registry passed in.

What describes one model's batches carries a ``model`` label (``for_model`` binds it); what
describes the shared queue and the device does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from .probes import MemoryLimit, MemoryReading

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip


def latency_buckets(max_s: float) -> tuple[float, ...]:
    """The standard latency buckets below ``max_s`` (the longest request deadline), then it."""
    return (*(b for b in LATENCY_BUCKETS_S if b < max_s), float(max_s))


MODEL = ("model",)
PADDING_RATIO_BUCKETS = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0)


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
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        max_batch_size: int,
        max_batch_tokens: int,
        max_latency_s: float = LATENCY_BUCKETS_S[-1],
    ) -> None:
        self.queue_depth = Gauge(
            "batchfit_queue_depth", "Items waiting in the queue.", registry=registry
        )
        self.queue_capacity = Gauge(
            "batchfit_queue_capacity", "Most items the queue admits.", registry=registry
        )
        self.queue_wait = Histogram(
            "batchfit_queue_wait_seconds",
            "Time an item waited from admission to the start of its batch; buckets up to "
            "--max-timeout-s.",
            buckets=latency_buckets(max_latency_s),
            labelnames=MODEL,
            registry=registry,
        )
        self.batch_size = Histogram(
            "batchfit_batch_size",
            "Items per forward pass; powers of two up to --max-batch-size.",
            buckets=powers_of_two(max_batch_size),
            labelnames=MODEL,
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "batchfit_batch_tokens",
            "Padded tokens (items x longest) per forward pass; powers of two up to "
            "--max-batch-tokens.",
            buckets=powers_of_two(max_batch_tokens),
            labelnames=MODEL,
            registry=registry,
        )
        self.batch_duration = Histogram(
            "batchfit_batch_duration_seconds",
            "Wall time of one forward pass on its thread (side by side: each its own).",
            buckets=LATENCY_BUCKETS_S,
            labelnames=MODEL,
            registry=registry,
        )
        self.real_tokens = Counter(
            "batchfit_batch_real_tokens",
            "Real (unpadded) tokens run through the model.",
            labelnames=MODEL,
            registry=registry,
        )
        self.padded_tokens = Counter(
            "batchfit_batch_padded_tokens",
            "Padded tokens run through the model; divide by real tokens for the padding ratio.",
            labelnames=MODEL,
            registry=registry,
        )
        self.padding_ratio = Histogram(
            "batchfit_batch_padding_ratio",
            "Padded over real tokens per forward pass (1 means no padding).",
            buckets=PADDING_RATIO_BUCKETS,
            labelnames=MODEL,
            registry=registry,
        )
        self.batch_failures = Counter(
            "batchfit_batch_failures",
            "Forward passes that failed for a reason other than memory.",
            labelnames=MODEL,
            registry=registry,
        )
        self.cancelled = Counter(
            "batchfit_cancelled_items",
            "Items whose request went away, by stage: queued (dropped before compute: client gone "
            "or deadline passed) or running (result discarded).",
            ["stage"],
            registry=registry,
        )
        for stage in ("queued", "running"):
            self.cancelled.labels(stage)
        self.passes_at_once = Gauge(
            "batchfit_cpu_passes",
            "Forward passes that may run at once: side by side on a CPU while work waits, each "
            "on its share of the threads (--cpu-passes); 1: one at a time.",
            registry=registry,
        )
        self.passes_at_once.set(1)
        self.side_by_side = Counter(
            "batchfit_side_by_side_batches",
            "Forward passes that ran beside another, on their share of the CPU threads (their "
            "peak memory is not measured).",
            registry=registry,
        )
        self.budget_items = Gauge(
            "batchfit_batch_budget_items",
            "Item budget of the next batch.",
            labelnames=MODEL,
            registry=registry,
        )
        self.budget_tokens = Gauge(
            "batchfit_batch_budget_tokens",
            "Padded-token budget of the next batch.",
            labelnames=MODEL,
            registry=registry,
        )

    def for_model(self, model: str) -> ModelBatchingMetrics:
        """This model's series (created now, so they read 0 before its first batch)."""
        return ModelBatchingMetrics(
            queue_wait=self.queue_wait.labels(model),
            batch_size=self.batch_size.labels(model),
            batch_tokens=self.batch_tokens.labels(model),
            batch_duration=self.batch_duration.labels(model),
            real_tokens=self.real_tokens.labels(model),
            padded_tokens=self.padded_tokens.labels(model),
            padding_ratio=self.padding_ratio.labels(model),
            batch_failures=self.batch_failures.labels(model),
            budget_items=self.budget_items.labels(model),
            budget_tokens=self.budget_tokens.labels(model),
        )


@dataclass(frozen=True, slots=True)
class ModelBatchingMetrics:
    """One model's children of ``BatchingMetrics``."""

    queue_wait: Histogram
    batch_size: Histogram
    batch_tokens: Histogram
    batch_duration: Histogram
    real_tokens: Counter
    padded_tokens: Counter
    padding_ratio: Histogram
    batch_failures: Counter
    budget_items: Gauge
    budget_tokens: Gauge


@dataclass(frozen=True, slots=True)
class ModelMemoryMetrics:
    """One model's children of ``MemoryMetrics``."""

    budget_bytes: Gauge
    ceiling_bytes: Gauge
    headroom_bytes: Gauge
    predicted_peak: Gauge
    measured_peak: Gauge
    peak_ratio: Histogram
    oom_split: Counter
    oom_failed: Counter
    refused: Counter
    proven_length: Gauge


class MemoryMetrics:
    """What the memory probes read (per device), and what each model's sizer predicted."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.budget_bytes = Gauge(
            "batchfit_batch_budget_bytes",
            "Predicted-peak budget of the next batch (free memory less headroom).",
            labelnames=MODEL,
            registry=registry,
        )
        self.ceiling_bytes = Gauge(
            "batchfit_batch_ceiling_bytes",
            "Cap on a batch's predicted peak: what warm-up proved (the largest warm-up batch), "
            "lowered after an OOM and climbing back after clean batches; 0: none (the fixed "
            "sizer, or a model not warmed up).",
            labelnames=MODEL,
            registry=registry,
        )
        self.free_bytes = Gauge(
            "batchfit_memory_free_bytes",
            "Memory the probes said was free at the last dispatch.",
            registry=registry,
        )
        self.headroom_bytes = Gauge(
            "batchfit_memory_headroom_bytes",
            "Free memory left over the predicted peak at the last dispatch.",
            labelnames=MODEL,
            registry=registry,
        )
        self.predicted_peak = Gauge(
            "batchfit_batch_predicted_peak_bytes",
            "Predicted peak memory of the last batch, above the memory in use before it.",
            labelnames=MODEL,
            registry=registry,
        )
        self.measured_peak = Gauge(
            "batchfit_batch_measured_peak_bytes",
            "Measured peak memory of the last batch, above the memory in use before it.",
            labelnames=MODEL,
            registry=registry,
        )
        self.peak_ratio = Histogram(
            "batchfit_batch_peak_ratio",
            "Measured over predicted peak per batch (below 1: the prediction was safe).",
            buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
            labelnames=MODEL,
            registry=registry,
        )
        self.oom_events = Counter(
            "batchfit_oom_events",
            "Forward passes that ran out of memory, by outcome: split (retried as two "
            "halves) or failed (a single input that does not fit; its request got 507).",
            ["model", "outcome"],
            registry=registry,
        )
        self.refused = Counter(
            "batchfit_oom_refusals",
            "Inputs answered 507 out_of_memory before they ran: alone, their predicted peak "
            "exceeded the room under a limit that kills rather than failing an allocation "
            "(a cgroup, the host's memory, a GPU shared with other processes).",
            labelnames=MODEL,
            registry=registry,
        )
        self.proven_length = Gauge(
            "batchfit_warmup_proven_tokens",
            "The longest input length (tokens) a warm-up batch ran at; beyond it the fitted "
            "memory model predicts.",
            labelnames=MODEL,
            registry=registry,
        )
        self.device_used = Gauge(
            "batchfit_device_memory_used_bytes",
            "Device memory in use by all processes (NVML; 0 on CPU).",
            registry=registry,
        )
        self.device_total = Gauge(
            "batchfit_device_memory_total_bytes",
            "Device memory in all (NVML; 0 on CPU).",
            registry=registry,
        )
        self.torch_allocated = Gauge(
            "batchfit_torch_allocated_bytes",
            "Memory held by tensors (torch.cuda.memory_allocated; 0 on CPU).",
            registry=registry,
        )
        self.torch_reserved = Gauge(
            "batchfit_torch_reserved_bytes",
            "Memory reserved by torch's caching allocator; minus allocated, the fragmentation gap.",
            registry=registry,
        )
        self.host_resident = Gauge(
            "batchfit_host_resident_bytes", "Resident memory of this process.", registry=registry
        )
        self.host_resident_peak = Gauge(
            "batchfit_host_resident_peak_bytes",
            "Highest resident memory of this process since it started (VmHWM, kept across "
            "the per-batch resets; as of the last dispatch).",
            registry=registry,
        )
        self.host_available = Gauge(
            "batchfit_host_available_bytes",
            "Memory the host could still give this process (MemAvailable, cgroup and "
            "address-space limits, the smallest).",
            registry=registry,
        )
        self.host_released = Counter(
            "batchfit_host_heap_released_bytes",
            "Resident memory handed back to the OS from the C allocator's free blocks after "
            "the replica went quiet (--memory-release-idle-s).",
            registry=registry,
        )
        self.host_last_release = Gauge(
            "batchfit_host_heap_last_release_timestamp_seconds",
            "When the replica last handed its free heap memory back (Unix time; 0: never).",
            registry=registry,
        )
        self.limit = Gauge(
            "batchfit_memory_limit_bytes",
            "The memory limit that binds (the one leaving the least room), by where it comes "
            "from: cgroup, rlimit, flag, host or device. One series at a time.",
            ["source"],
            registry=registry,
        )
        self.probe_error = Gauge(
            "batchfit_probe_error",
            "1 while a memory probe cannot be read (it is retried with backoff; its last "
            "reading and the ceiling proven at warm-up bound the budget meanwhile), else 0; "
            "as of the last dispatch.",
            ["probe"],
            registry=registry,
        )
        self._limit_source: str | None = None
        self._limit_shown: tuple[str, int] | None = None

    def set_limit(self, limit: MemoryLimit | None) -> None:
        """Show ``limit`` as the binding one; the series of the source before it goes."""
        if limit is None:
            return
        if (limit.source, limit.limit_bytes) == self._limit_shown:
            return  # read before every batch, and it seldom changes
        if self._limit_source is not None and self._limit_source != limit.source:
            self.limit.remove(self._limit_source)
        self._limit_source = limit.source
        self._limit_shown = (limit.source, limit.limit_bytes)
        self.limit.labels(limit.source).set(limit.limit_bytes)

    def set_probe_states(self, reading: MemoryReading) -> None:
        """Each probe of ``reading``: 0 if it read, 1 if it is in error."""
        for name in reading.sources:
            self.probe_error.labels(name).set(0)
        for name in reading.failing:
            self.probe_error.labels(name).set(1)

    def for_model(self, model: str) -> ModelMemoryMetrics:
        """This model's series (created now, so they read 0 before its first batch)."""
        return ModelMemoryMetrics(
            budget_bytes=self.budget_bytes.labels(model),
            ceiling_bytes=self.ceiling_bytes.labels(model),
            headroom_bytes=self.headroom_bytes.labels(model),
            predicted_peak=self.predicted_peak.labels(model),
            measured_peak=self.measured_peak.labels(model),
            peak_ratio=self.peak_ratio.labels(model),
            oom_split=self.oom_events.labels(model, "split"),
            oom_failed=self.oom_events.labels(model, "failed"),
            refused=self.refused.labels(model),
            proven_length=self.proven_length.labels(model),
        )
