"""Summaries of a run: throughput, latency percentiles, errors, and what the server's
``/metrics`` says about batching (mean batch size, padding ratio)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from .loadgen import Outcome
from .wrk import WrkResult


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True, slots=True)
class LoadSummary:
    """One load level of one configuration."""

    config: str
    load: str
    num_requests: int
    num_inputs: int
    wall_s: float
    requests_per_s: float
    inputs_per_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float
    errors: dict[str, int] = field(default_factory=dict)
    mean_batch_size: float = math.nan
    padding_ratio: float = math.nan
    mean_queue_wait_s: float = math.nan
    """Server side: admission to the start of the item's batch (fill window included)."""
    cpu_ms_per_input: float = math.nan
    """Server process CPU time per successful input: robust to a shared host."""
    peak_rss_bytes: int | None = None
    mean_s: float = math.nan
    """Mean latency of the successful requests."""
    client: str = "aiohttp"
    """The load generator: aiohttp (the benchmark's own), httpx or wrk."""


def summarize(
    config: str,
    load: str,
    outcomes: Sequence[Outcome],
    wall_s: float,
    *,
    metrics_before: Mapping[str, float] | None = None,
    metrics_after: Mapping[str, float] | None = None,
    peak_rss_bytes: int | None = None,
    cpu_s: float | None = None,
    client: str = "aiohttp",
) -> LoadSummary:
    """Throughput counts successful requests only; latency percentiles are over them too."""
    ok = [o for o in outcomes if o.status == 200]
    latencies = [o.latency_s for o in ok]
    inputs = sum(o.num_inputs for o in ok)
    errors = Counter(str(o.status) for o in outcomes if o.status != 200)
    batch, padding, wait = math.nan, math.nan, math.nan
    if metrics_before is not None and metrics_after is not None:
        batch, padding = batching_figures(metrics_before, metrics_after)
        wait = _mean(metrics_before, metrics_after, "batchfit_queue_wait_seconds")
    wall = max(wall_s, 1e-9)
    return LoadSummary(
        config=config,
        load=load,
        num_requests=len(ok),
        num_inputs=inputs,
        wall_s=wall_s,
        requests_per_s=len(ok) / wall,
        inputs_per_s=inputs / wall,
        p50_s=percentile(latencies, 50),
        p90_s=percentile(latencies, 90),
        p99_s=percentile(latencies, 99),
        max_s=max(latencies, default=math.nan),
        errors=dict(sorted(errors.items())),
        mean_batch_size=batch,
        padding_ratio=padding,
        mean_queue_wait_s=wait,
        cpu_ms_per_input=cpu_s * 1e3 / inputs if cpu_s is not None and inputs else math.nan,
        peak_rss_bytes=peak_rss_bytes,
        mean_s=sum(latencies) / len(latencies) if latencies else math.nan,
        client=client,
    )


def summarize_wrk(config: str, run: WrkResult, *, cpu_s: float | None = None) -> LoadSummary:
    """A wrk run of single-input requests (wrk counts non-2xx answers as errors)."""
    ok = run.requests - run.errors
    wall = max(run.duration_s, 1e-9)
    return LoadSummary(
        config=config,
        load=f"c={run.connections}",
        num_requests=ok,
        num_inputs=ok,
        wall_s=run.duration_s,
        requests_per_s=ok / wall,
        inputs_per_s=ok / wall,
        p50_s=run.p50_s,
        p90_s=math.nan,
        p99_s=run.p99_s,
        max_s=run.max_s,
        errors={"wrk": run.errors} if run.errors else {},
        cpu_ms_per_input=cpu_s * 1e3 / ok if cpu_s is not None and ok else math.nan,
        mean_s=run.mean_s,
        client="wrk",
    )


# The samples of a scrape that the benchmark reads.
SAMPLES = (
    "batchfit_batch_size_sum",
    "batchfit_batch_size_count",
    "batchfit_batch_real_tokens_total",
    "batchfit_batch_padded_tokens_total",
    "batchfit_queue_wait_seconds_sum",
    "batchfit_queue_wait_seconds_count",
)


def _mean(before: Mapping[str, float], after: Mapping[str, float], histogram: str) -> float:
    count = after.get(histogram + "_count", 0.0) - before.get(histogram + "_count", 0.0)
    total = after.get(histogram + "_sum", 0.0) - before.get(histogram + "_sum", 0.0)
    return total / count if count > 0 else math.nan


def parse_scrape(text: str) -> dict[str, float]:
    """The samples of a Prometheus text scrape that have no labels but ``model``, by name,
    summed over the models."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels.keys() - {"model"}:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def batching_figures(
    before: Mapping[str, float], after: Mapping[str, float]
) -> tuple[float, float]:
    """Mean batch size and padding ratio (padded / real tokens) between two scrapes."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    batches = delta("batchfit_batch_size_count")
    real = delta("batchfit_batch_real_tokens_total")
    mean_batch = delta("batchfit_batch_size_sum") / batches if batches > 0 else math.nan
    padding = delta("batchfit_batch_padded_tokens_total") / real if real > 0 else math.nan
    return mean_batch, padding
