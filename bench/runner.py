"""One benchmark run: the in-process limit, then each server configuration at each load level."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .limit import Batch1Timer, LimitResult, measure_limit
from .loadgen import RunResult, closed_loop, open_loop
from .plain import load_plain_encoder
from .sampler import Sample, Sampler
from .servers import Replica, start_replicas
from .stats import LoadSummary, parse_scrape, percentile, summarize
from .workload import WorkloadSpec, arrival_times, make_requests

log = logging.getLogger("batchfit.bench")

# Batching off, fixed batch sizes, and the server's defaults ("adaptive" once the adaptive
# sizer is the default).
# Batching off, fixed caps on the batch (the sizer and the planner still choose within
# them), and the server's defaults. Every configuration runs with the same thread count: the
# server's default, unless --server-flag sets one for all.
FIXED_BATCH_TOKENS = "4096"
SERVER_CONFIGS: dict[str, tuple[str, ...]] = {
    "off": ("--max-batch-size", "1"),
    "fixed-8": ("--max-batch-size", "8", "--max-batch-tokens", FIXED_BATCH_TOKENS),
    "fixed-64": ("--max-batch-size", "64", "--max-batch-tokens", FIXED_BATCH_TOKENS),
    "fixed-128": ("--max-batch-size", "128", "--max-batch-tokens", FIXED_BATCH_TOKENS),
    "adaptive": (),
}
FIXED_CONFIGS = ("fixed-8", "fixed-64", "fixed-128")
NOOP_MODEL = "python:bench.noop:create"
"""A model that does no work: the server's own CPU per request, measured apart."""


@dataclass(frozen=True, slots=True)
class BenchOptions:
    configs: tuple[str, ...] = tuple(SERVER_CONFIGS)
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    rates: tuple[float, ...] = ()
    requests_per_level: int = 400
    duration_s: float = 10.0
    """Length of each open-loop level."""
    max_level_s: float = 120.0
    """A closed-loop level stops after this long even if requests remain."""
    idle_requests: int = 100
    """Single-input requests sent one at a time for the idle-latency target."""
    overhead_requests: int = 400
    """Single-input requests per level against the no-op model (0: skip that part)."""
    overhead_concurrency: tuple[int, ...] = (1, 32)
    seed: int = 0
    max_batch_size: int = 128
    max_batch_tokens: int = 4096
    """The in-process limit's budget: the server's defaults."""
    extra_server_flags: tuple[str, ...] = ()
    parallel_start: bool = False
    """Start every configuration's replica at once (quicker, less isolated)."""
    quick: bool = False
    """A smoke test (``--quick``): its figures are not set against the targets."""

    def __post_init__(self) -> None:
        unknown = [c for c in self.configs if c not in SERVER_CONFIGS]
        if unknown:
            raise ValueError(f"unknown configs {unknown}; expected some of {list(SERVER_CONFIGS)}")
        if not self.concurrency and not self.rates:
            raise ValueError("give at least one concurrency or rate level")
        if any(c < 1 for c in self.concurrency) or any(r <= 0 for r in self.rates):
            raise ValueError("concurrency levels and rates must be positive")
        if self.overhead_requests < 0 or any(c < 1 for c in self.overhead_concurrency):
            raise ValueError("overhead requests must be >= 0 and its concurrency positive")


@dataclass
class BenchResult:
    options: BenchOptions
    limit: LimitResult
    summaries: list[LoadSummary] = field(default_factory=list)
    idle: dict[str, LoadSummary] = field(default_factory=dict)
    limit_before_top: dict[str, LimitResult] = field(default_factory=dict)
    """By configuration: the limit measured again just before its highest load level, so
    that the saturation ratio does not compare moments minutes apart on a noisy host."""
    batch1_p50_s: dict[str, float] = field(default_factory=dict)
    """By configuration: the median in-process forward of one input alone, timed between
    that configuration's one-client requests on the same inputs."""
    overhead: list[LoadSummary] = field(default_factory=list)
    """The no-op model's levels: the server's own CPU time and latency per request."""
    timeline_config: str = ""
    timeline_load: str = ""
    timeline: list[Sample] = field(default_factory=list)
    started_at: str = ""
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    cpu_count: int = 0
    wall_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    measured: str
    goal: str
    ratio: float
    met: bool | None


def load_levels(options: BenchOptions) -> list[str]:
    return [f"c={c}" for c in options.concurrency] + [f"r={r:g}/s" for r in options.rates]


def run_bench(options: BenchOptions, *, progress: Callable[[str], None] = log.info) -> BenchResult:
    started = time.perf_counter()
    spec = WorkloadSpec(seed=options.seed)
    requests = make_requests(spec, options.requests_per_level)
    singles = make_requests(spec, options.idle_requests, single_input=True)
    progress(f"in-process limit over {sum(len(r) for r in requests)} inputs")
    encoder = load_plain_encoder()
    texts = [text for r in requests for text in r]

    def measure() -> LimitResult:
        return measure_limit(encoder, texts, max_items=options.max_batch_size,
                             max_tokens=options.max_batch_tokens)  # fmt: skip

    limit = measure()
    progress(f"limit: {limit.inputs_per_s:.1f} inputs/s")
    result = BenchResult(
        options=options,
        limit=limit,
        started_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        load_average=os.getloadavg(),
        cpu_count=os.cpu_count() or 0,
    )
    levels = load_levels(options)
    timeline_config = "adaptive" if "adaptive" in options.configs else options.configs[-1]
    result.timeline_config, result.timeline_load = timeline_config, levels[-1]
    # One configuration at a time, so idle replicas cannot disturb the one measured; the
    # quick mode starts them together to save the start-up time.
    groups = [options.configs] if options.parallel_start else [(c,) for c in options.configs]
    for group in groups:
        flag_lists = [[*SERVER_CONFIGS[c], *options.extra_server_flags] for c in group]
        progress(f"starting {', '.join(group)}")
        with start_replicas(flag_lists) as replicas:
            for config, replica in zip(group, replicas, strict=True):
                _run_config(result, replica, config, levels, requests, singles, spec,
                            Batch1Timer(encoder, [r[0] for r in singles]), measure,
                            timeline=config == timeline_config, progress=progress)  # fmt: skip
    if options.overhead_requests:
        progress("server overhead with the no-op model")
        result.overhead = measure_overhead(options, spec, progress=progress)
    result.wall_s = time.perf_counter() - started
    return result


def measure_overhead(
    options: BenchOptions, spec: WorkloadSpec, *, progress: Callable[[str], None] = log.info
) -> list[LoadSummary]:
    """Single-input requests against a replica serving the no-op model: what HTTP, the
    queue, the batcher and the hand-offs cost per request in server CPU and in latency."""
    singles = make_requests(spec, options.overhead_requests, single_input=True)
    summaries = []
    with start_replicas([["--model", NOOP_MODEL, *options.extra_server_flags]]) as (replica,):
        asyncio.run(_warm_up(replica.url, singles))
        for concurrency in options.overhead_concurrency:
            cpu_before = replica.cpu_seconds()
            run = asyncio.run(closed_loop(replica.url, singles, concurrency=concurrency,
                                          max_duration_s=options.max_level_s))  # fmt: skip
            cpu_after = replica.cpu_seconds()
            cpu_s = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
            summary = summarize("no-op model", f"c={concurrency}", run.outcomes, run.wall_s,
                                cpu_s=cpu_s)  # fmt: skip
            summaries.append(summary)
            progress(
                f"no-op c={concurrency}: {summary.requests_per_s:.0f} requests/s, "
                f"p50 {summary.p50_s * 1e3:.2f} ms, "
                f"server CPU {summary.cpu_ms_per_input:.2f} ms/request"
            )
    return summaries


def _run_config(
    result: BenchResult,
    replica: Replica,
    config: str,
    levels: list[str],
    requests: list[list[str]],
    singles: list[list[str]],
    spec: WorkloadSpec,
    batch1: Batch1Timer,
    measure_limit_now: Callable[[], LimitResult],
    *,
    timeline: bool,
    progress: Callable[[str], None],
) -> None:
    options = result.options
    asyncio.run(_warm_up(replica.url, requests))
    before = _scrape(replica.url)
    idle = asyncio.run(closed_loop(replica.url, singles, concurrency=1, after_each=batch1,
                                   max_duration_s=options.max_level_s))  # fmt: skip
    after = _scrape(replica.url)
    result.idle[config] = summarize(config, "idle c=1", idle.outcomes, idle.wall_s,
                                    metrics_before=before, metrics_after=after)  # fmt: skip
    result.batch1_p50_s[config] = percentile(batch1.latencies_s, 50)
    progress(
        f"{config} idle: p50 {result.idle[config].p50_s * 1e3:.2f} ms, "
        f"in-process batch-1 p50 {result.batch1_p50_s[config] * 1e3:.2f} ms"
    )
    for level in levels:
        if level == levels[-1]:
            limit = result.limit_before_top[config] = measure_limit_now()
            progress(f"limit before {config} {level}: {limit.inputs_per_s:.1f} inputs/s")
        last = timeline and level == levels[-1]
        summary, samples = _run_level(replica, config, level, requests, spec, options,
                                      scrape=last)  # fmt: skip
        result.summaries.append(summary)
        if last:
            result.timeline = samples
        progress(
            f"{config} {level}: {summary.inputs_per_s:.1f} inputs/s, "
            f"p99 {summary.p99_s * 1e3:.1f} ms, errors {summary.errors or 'none'}"
        )


def _run_level(
    replica: Replica,
    config: str,
    level: str,
    requests: list[list[str]],
    spec: WorkloadSpec,
    options: BenchOptions,
    *,
    scrape: bool,
) -> tuple[LoadSummary, list[Sample]]:
    before = _scrape(replica.url)
    cpu_before = replica.cpu_seconds()
    with Sampler(replica, scrape=scrape) as sampler:
        run: RunResult
        if level.startswith("c="):
            run = asyncio.run(closed_loop(replica.url, requests, concurrency=int(level[2:]),
                                          max_duration_s=options.max_level_s))  # fmt: skip
        else:
            rate = float(level[2:].removesuffix("/s"))
            times = arrival_times(spec, rate, options.duration_s)
            pool = make_requests(WorkloadSpec(seed=options.seed + 1), len(times))
            run = asyncio.run(open_loop(replica.url, pool, times))
    after = _scrape(replica.url)
    cpu_after = replica.cpu_seconds()
    cpu_s = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    summary = summarize(config, level, run.outcomes, run.wall_s, metrics_before=before,
                        metrics_after=after, peak_rss_bytes=sampler.peak_rss_bytes,
                        cpu_s=cpu_s)  # fmt: skip
    return summary, sampler.samples


def _scrape(url: str) -> dict[str, float]:
    return parse_scrape(httpx.get(f"{url}/metrics", timeout=10).text)


async def _warm_up(url: str, requests: list[list[str]]) -> None:
    """A few requests of each shape, so first-call costs stay out of the figures."""
    await closed_loop(url, requests[:16], concurrency=8, max_duration_s=60)


SATURATION_GOAL = 0.85
"""Adaptive's best throughput / the all-core in-process limit measured just before it."""
IDLE_ALLOWANCE_S = 0.0015
"""One client's p50 may exceed the in-process batch-1 forward by this much."""
FIXED_GOAL = 0.95
"""Adaptive / the best fixed configuration, at every load level."""


def targets(result: BenchResult) -> list[Target]:
    """The targets as ratios, where this run has the configurations they need."""
    out: list[Target] = []
    limit = result.limit_before_top.get("adaptive", result.limit)
    by_config: dict[str, list[LoadSummary]] = {}
    for s in result.summaries:
        by_config.setdefault(s.config, []).append(s)
    best = {c: max(rows, key=lambda s: s.inputs_per_s) for c, rows in by_config.items()}
    if "adaptive" in best:
        sat = best["adaptive"]
        ratio = sat.inputs_per_s / limit.inputs_per_s
        out.append(Target(
            "saturation throughput vs in-process limit (all cores)",
            f"{sat.inputs_per_s:.1f} vs {limit.inputs_per_s:.1f} inputs/s ({sat.load})",
            f">= {SATURATION_GOAL:.2f}", ratio, ratio >= SATURATION_GOAL,
        ))  # fmt: skip
        # The same ratio in CPU time per input, which a shared host disturbs less than
        # wall-clock throughput.
        if not math.isnan(sat.cpu_ms_per_input) and not math.isnan(limit.cpu_ms_per_input):
            cpu_ratio = limit.cpu_ms_per_input / sat.cpu_ms_per_input
            out.append(Target(
                "CPU time per input, limit vs server at saturation",
                f"{limit.cpu_ms_per_input:.2f} vs {sat.cpu_ms_per_input:.2f} ms ({sat.load})",
                f">= {SATURATION_GOAL:.2f}", cpu_ratio, cpu_ratio >= SATURATION_GOAL,
            ))  # fmt: skip
    if "adaptive" in result.idle and "adaptive" in result.batch1_p50_s:
        p50 = result.idle["adaptive"].p50_s
        batch1 = result.batch1_p50_s["adaptive"]
        allowed = batch1 + IDLE_ALLOWANCE_S
        out.append(Target(
            f"one-client p50 vs batch-1 latency + {IDLE_ALLOWANCE_S * 1e3:g} ms",
            f"{p50 * 1e3:.2f} vs {batch1 * 1e3:.2f} + {IDLE_ALLOWANCE_S * 1e3:g} ms",
            "<= 1.00", p50 / allowed, p50 <= allowed,
        ))  # fmt: skip
    if fixed := _against_fixed(by_config):
        out.append(fixed)
    if "adaptive" in best and "off" in best:
        on, off = best["adaptive"], best["off"]
        ratio = on.inputs_per_s / off.inputs_per_s
        # p99 compared at the same load level: the highest both ran.
        top = [s for s in by_config["adaptive"] if s.load == by_config["off"][-1].load]
        p99_on = top[0].p99_s if top else on.p99_s
        p99_off = by_config["off"][-1].p99_s
        out.append(Target(
            "batching on vs off at saturation (throughput)",
            f"{on.inputs_per_s:.1f} vs {off.inputs_per_s:.1f} inputs/s",
            "well above 1", ratio, ratio > 1.5,
        ))  # fmt: skip
        out.append(Target(
            "p99 on vs off at the highest load",
            f"{p99_on * 1e3:.1f} vs {p99_off * 1e3:.1f} ms ({by_config['off'][-1].load})",
            "<= 1.00", p99_on / p99_off if p99_off else math.nan,
            p99_on <= p99_off,
        ))  # fmt: skip
    return out


def _against_fixed(by_config: dict[str, list[LoadSummary]]) -> Target | None:
    """Adaptive's throughput over the best fixed configuration's, at the level where that
    ratio is lowest."""
    fixed = [c for c in FIXED_CONFIGS if c in by_config]
    if "adaptive" not in by_config or not fixed:
        return None
    worst: tuple[float, str] | None = None
    for row in by_config["adaptive"]:
        rivals = [s for c in fixed for s in by_config[c] if s.load == row.load]
        if not rivals:
            continue
        rival = max(rivals, key=lambda s: s.inputs_per_s)
        ratio = row.inputs_per_s / rival.inputs_per_s if rival.inputs_per_s else math.nan
        text = (
            f"{row.inputs_per_s:.1f} vs {rival.config} {rival.inputs_per_s:.1f} inputs/s "
            f"({row.load}, the lowest ratio of {len(by_config['adaptive'])} levels)"
        )
        if worst is None or ratio < worst[0]:
            worst = (ratio, text)
    if worst is None:
        return None
    ratio, text = worst
    return Target(
        "adaptive vs the best fixed configuration at every level", text,
        f">= {FIXED_GOAL:.2f}", ratio, ratio >= FIXED_GOAL,
    )  # fmt: skip


def quick_options(**overrides: object) -> BenchOptions:
    """Small counts for a smoke test: off and adaptive, two load levels."""
    base: dict[str, object] = {
        "configs": ("off", "adaptive"),
        "concurrency": (1, 8),
        "requests_per_level": 24,
        "idle_requests": 10,
        "overhead_requests": 40,
        "max_level_s": 20.0,
        "parallel_start": True,
        "quick": True,
    }
    base.update(overrides)
    return BenchOptions(**base)  # type: ignore[arg-type]
