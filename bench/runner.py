"""One benchmark run: the in-process limit, then each server configuration at each load level."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .comparisons import cpu_delta, measure_no_batching, measure_overhead, warm_up
from .limit import Batch1Timer, LimitResult, measure_limit
from .loadgen import CLIENTS, RunResult, closed_loop, open_loop
from .plain import load_plain_encoder
from .sampler import Sample, Sampler
from .servers import Replica, start_replicas
from .stats import LoadSummary, parse_scrape, percentile, summarize
from .workload import WorkloadSpec, arrival_times, make_requests

log = logging.getLogger("batchfit.bench")

# Batching off, fixed caps on the batch (the sizer and the planner still choose within
# them), and the server's defaults. Every configuration runs with the same thread count: the
# server's default, unless --server-flag sets one for all.
FIXED_BATCH_TOKENS = "4096"
SERVER_CONFIGS: dict[str, tuple[str, ...]] = {
    "off": ("--max-batch-size", "1"),
    "fixed-8": ("--max-batch-size", "8", "--max-batch-tokens", FIXED_BATCH_TOKENS),
    "fixed-64": ("--max-batch-size", "64", "--max-batch-tokens", FIXED_BATCH_TOKENS),
    "fixed-128": ("--max-batch-size", "128", "--max-batch-tokens", FIXED_BATCH_TOKENS),
    # The server's defaults, but one forward pass at a time on a CPU (no passes side by side).
    "one-pass": ("--cpu-passes", "1"),
    "adaptive": (),
}
OVERHEAD_LOADS = ("wrk", "aiohttp")


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
    overhead_load: str = "wrk"
    """The no-op phase's load generator: wrk (C, a fixed time per level; aiohttp where wrk
    is not installed) or aiohttp (``overhead_requests`` per level)."""
    overhead_duration_s: float = 10.0
    """Length of each wrk level."""
    clients: tuple[str, ...] = CLIENTS
    """Load generators for the real model: the first drives every level; the others run
    adaptive's one-client and highest levels again, and the no-batching server's."""
    baselines: bool = True
    """Run the bare stack beside the no-op model and the no-batching server beside the
    configurations, for the targets set against them."""
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
        if self.overhead_load not in OVERHEAD_LOADS or self.overhead_duration_s <= 0:
            raise ValueError(
                f"overhead load must be one of {OVERHEAD_LOADS} with a positive duration"
            )
        if not self.clients or any(c not in CLIENTS for c in self.clients):
            raise ValueError(f"clients must be some of {list(CLIENTS)}, got {self.clients}")


@dataclass
class BenchResult:
    options: BenchOptions
    limit: LimitResult
    summaries: list[LoadSummary] = field(default_factory=list)
    idle: dict[str, LoadSummary] = field(default_factory=dict)
    limit_before_top: dict[str, LimitResult] = field(default_factory=dict)
    """By configuration: the limit measured again just before its highest load level, so
    that the saturation ratio does not compare moments minutes apart on a noisy host."""
    limit_after_top: dict[str, LimitResult] = field(default_factory=dict)
    """Adaptive's: the limit measured again just after its highest load level (not in the
    quick mode)."""
    batch1_p50_s: dict[str, float] = field(default_factory=dict)
    """By configuration: the median in-process forward of one input alone, timed between
    that configuration's one-client requests on the same inputs."""
    overhead: list[LoadSummary] = field(default_factory=list)
    """The no-op model's levels: the server's own CPU time and latency per request."""
    bare: list[LoadSummary] = field(default_factory=list)
    """The bare stack's levels, under the same load as the no-op model's, interleaved."""
    no_batching: list[LoadSummary] = field(default_factory=list)
    """The no-batching server: one client with each load generator, and the highest level."""
    beside_no_batching: list[LoadSummary] = field(default_factory=list)
    """Adaptive's one-client levels, each request sent to it and to the no-batching server
    in turn (load ``IN_TURN``), one per load generator."""
    other_clients: list[LoadSummary] = field(default_factory=list)
    """Adaptive's highest level with the load generators after the first (and its one-client
    level, where the no-batching comparison does not run)."""
    timeline_config: str = ""
    timeline_load: str = ""
    timeline: list[Sample] = field(default_factory=list)
    started_at: str = ""
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    cpu_count: int = 0
    wall_s: float = 0.0


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
            if options.baselines and "adaptive" in group:
                # While adaptive's replica is still up: one client in turn with both.
                progress("the no-batching server, beside adaptive")
                adaptive = replicas[group.index("adaptive")]
                result.no_batching, result.beside_no_batching = measure_no_batching(
                    options, requests, singles, beside=adaptive, progress=progress
                )
    if options.baselines and not result.no_batching:
        progress("the no-batching server")
        result.no_batching, _ = measure_no_batching(options, requests, singles, progress=progress)
    if options.overhead_requests:
        progress("server overhead with the no-op model")
        result.overhead, result.bare = measure_overhead(options, spec, progress=progress)
    result.wall_s = time.perf_counter() - started
    return result


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
    asyncio.run(warm_up(replica.url, requests))
    before = _scrape(replica.url)
    client = options.clients[0]
    idle = asyncio.run(closed_loop(replica.url, singles, concurrency=1, after_each=batch1,
                                   max_duration_s=options.max_level_s, client=client))  # fmt: skip
    after = _scrape(replica.url)
    result.idle[config] = summarize(config, "idle c=1", idle.outcomes, idle.wall_s,
                                    metrics_before=before, metrics_after=after,
                                    client=client)  # fmt: skip
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
    if config == "adaptive" and not options.quick:
        # The limit again just after, so that the saturation ratio is set against the limit
        # on either side of the level (the same batches moved by half within one run).
        limit = result.limit_after_top[config] = measure_limit_now()
        progress(f"limit after {config} {levels[-1]}: {limit.inputs_per_s:.1f} inputs/s")
    if config == "adaptive":
        _run_other_clients(result, replica, requests, singles, options, progress=progress)


def _run_other_clients(
    result: BenchResult,
    replica: Replica,
    requests: list[list[str]],
    singles: list[list[str]],
    options: BenchOptions,
    *,
    progress: Callable[[str], None],
) -> None:
    """Adaptive's highest closed-loop level again, with each load generator after the first
    (its own CPU is part of what it measures), and its one-client level where the
    no-batching server's comparison (in turn, with every client) does not measure it."""
    for client in options.clients[1:]:
        if not options.baselines:
            idle = asyncio.run(closed_loop(replica.url, singles, concurrency=1, client=client,
                                           max_duration_s=options.max_level_s))  # fmt: skip
            result.other_clients.append(
                summarize("adaptive", "idle c=1", idle.outcomes, idle.wall_s, client=client)
            )
            progress(f"adaptive, one {client} client: p50 "
                     f"{result.other_clients[-1].p50_s * 1e3:.2f} ms")  # fmt: skip
        if not options.concurrency:
            continue
        top = max(options.concurrency)
        cpu_before = replica.cpu_seconds()
        run = asyncio.run(closed_loop(replica.url, requests, concurrency=top, client=client,
                                      max_duration_s=options.max_level_s))  # fmt: skip
        cpu_s = cpu_delta(cpu_before, replica.cpu_seconds())
        summary = summarize("adaptive", f"c={top}", run.outcomes, run.wall_s, cpu_s=cpu_s,
                            client=client)  # fmt: skip
        result.other_clients.append(summary)
        progress(f"adaptive with {client}: c={top} {summary.inputs_per_s:.1f} inputs/s")


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
    client = options.clients[0]
    with Sampler(replica, scrape=scrape) as sampler:
        run: RunResult
        if level.startswith("c="):
            run = asyncio.run(closed_loop(replica.url, requests, concurrency=int(level[2:]),
                                          max_duration_s=options.max_level_s,
                                          client=client))  # fmt: skip
        else:
            rate = float(level[2:].removesuffix("/s"))
            times = arrival_times(spec, rate, options.duration_s)
            pool = make_requests(WorkloadSpec(seed=options.seed + 1), len(times))
            run = asyncio.run(open_loop(replica.url, pool, times, client=client))
    after = _scrape(replica.url)
    cpu_after = replica.cpu_seconds()
    cpu_s = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    summary = summarize(config, level, run.outcomes, run.wall_s, metrics_before=before,
                        metrics_after=after, peak_rss_bytes=sampler.peak_rss_bytes,
                        cpu_s=cpu_s, client=client)  # fmt: skip
    return summary, sampler.samples


def _scrape(url: str) -> dict[str, float]:
    return parse_scrape(httpx.get(f"{url}/metrics", timeout=10).text)


def quick_options(**overrides: object) -> BenchOptions:
    """Small counts for a smoke test: off and adaptive, two load levels."""
    base: dict[str, object] = {
        "configs": ("off", "adaptive"),
        "concurrency": (1, 8),
        "requests_per_level": 24,
        "idle_requests": 10,
        "overhead_requests": 40,
        "overhead_duration_s": 2.0,
        "max_level_s": 20.0,
        "parallel_start": True,
        "quick": True,
    }
    base.update(overrides)
    return BenchOptions(**base)  # type: ignore[arg-type]
