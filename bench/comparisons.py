"""The servers a run compares adaptive with, each beside what it is compared to: the
no-batching server (one client in turn with adaptive's idle replica, then the highest level)
and the no-op model beside the bare stack (what the server itself costs per request)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import wrk
from .baselines import BARE_APP, NO_BATCHING_APP
from .loadgen import IN_TURN, closed_loop, encode_bodies, in_turn
from .servers import Replica, start_baseline, start_replicas
from .stats import LoadSummary, summarize, summarize_wrk
from .workload import WorkloadSpec, make_requests

if TYPE_CHECKING:
    from .runner import BenchOptions

log = logging.getLogger("batchfit.bench")

NOOP_MODEL = "python:bench.noop:create"
"""A model that does no work: the server's own CPU per request, measured apart."""
NOOP = "no-op model"
BARE = "bare stack"
NO_BATCHING = "no batching"
WRK_ROUND_S = 2
"""A wrk level of the no-op phase runs in rounds this long, the servers in turn."""


async def warm_up(url: str, requests: list[list[str]]) -> None:
    """A few requests of each shape, so first-call costs stay out of the figures."""
    await closed_loop(url, requests[:16], concurrency=8, max_duration_s=60)


def cpu_delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def measure_no_batching(
    options: BenchOptions,
    requests: list[list[str]],
    singles: list[list[str]],
    *,
    beside: Replica | None = None,
    progress: Callable[[str], None] = log.info,
) -> tuple[list[LoadSummary], list[LoadSummary]]:
    """The bundled model behind a plain FastAPI endpoint and one model thread: one client
    with each load generator, then the highest level with the first. With ``beside`` (the
    adaptive replica, idle), its one-client requests go to both servers in turn (``in_turn``),
    so that the two are compared at the same moments. Returns the no-batching server's rows
    and, with ``beside``, adaptive's one-client rows measured in turn with it."""
    rows, paired = [], []
    with start_baseline(NO_BATCHING_APP) as server:
        asyncio.run(warm_up(server.url, requests))
        for client in options.clients:
            if beside is None:
                run = asyncio.run(closed_loop(server.url, singles, concurrency=1, client=client,
                                              max_duration_s=options.max_level_s))  # fmt: skip
                rows.append(summarize(NO_BATCHING, "idle c=1", run.outcomes, run.wall_s,
                                      client=client))  # fmt: skip
                progress(f"no batching, one {client} client: p50 {rows[-1].p50_s * 1e3:.2f} ms")
                continue
            ours, theirs = asyncio.run(in_turn([beside.url, server.url], singles, client=client,
                                               max_duration_s=options.max_level_s))  # fmt: skip
            paired.append(summarize("adaptive", IN_TURN, ours.outcomes, ours.wall_s,
                                    client=client))  # fmt: skip
            rows.append(summarize(NO_BATCHING, IN_TURN, theirs.outcomes, theirs.wall_s,
                                  client=client))  # fmt: skip
            progress(
                f"one {client} client in turn: p50 adaptive {paired[-1].p50_s * 1e3:.2f} ms, "
                f"no batching {rows[-1].p50_s * 1e3:.2f} ms"
            )
        if options.concurrency:
            top = max(options.concurrency)
            cpu_before = server.cpu_seconds()
            run = asyncio.run(closed_loop(server.url, requests, concurrency=top,
                                          client=options.clients[0],
                                          max_duration_s=options.max_level_s))  # fmt: skip
            cpu_s = cpu_delta(cpu_before, server.cpu_seconds())
            rows.append(summarize(NO_BATCHING, f"c={top}", run.outcomes, run.wall_s,
                                  cpu_s=cpu_s, client=options.clients[0]))  # fmt: skip
            progress(f"no batching c={top}: {rows[-1].inputs_per_s:.1f} inputs/s")
    return rows, paired


def measure_overhead(
    options: BenchOptions, spec: WorkloadSpec, *, progress: Callable[[str], None] = log.info
) -> tuple[list[LoadSummary], list[LoadSummary]]:
    """Single-input requests against a replica serving the no-op model, and (with
    ``baselines``) against the bare stack, level by level in turn: what HTTP, the queue, the
    batcher and the hand-offs cost per request in server CPU and in latency, and what the
    stack they are built on costs at least. Returns the no-op rows and the bare-stack rows."""
    singles = make_requests(spec, options.overhead_requests, single_input=True)
    use_wrk = options.overhead_load == "wrk" and wrk.available()
    if options.overhead_load == "wrk" and not use_wrk:
        progress("wrk is not installed: the no-op phase uses the aiohttp client")
    with contextlib.ExitStack() as stack:
        servers = {NOOP: stack.enter_context(
            start_replicas([["--model", NOOP_MODEL, *options.extra_server_flags]])
        )[0]}  # fmt: skip
        if options.baselines:
            servers[BARE] = stack.enter_context(start_baseline(BARE_APP))
        for server in servers.values():
            asyncio.run(warm_up(server.url, singles))
        rows: dict[str, list[LoadSummary]] = {name: [] for name in servers}
        body = encode_bodies([_short_single(singles)])[0]
        for concurrency in options.overhead_concurrency:
            if use_wrk:
                level = wrk_in_turn(servers, body, concurrency, options.overhead_duration_s)
            else:
                level = {}
                for name, server in servers.items():
                    cpu_before = server.cpu_seconds()
                    done = asyncio.run(closed_loop(server.url, singles, concurrency=concurrency,
                                                   max_duration_s=options.max_level_s,
                                                   client=options.clients[0]))  # fmt: skip
                    cpu_s = cpu_delta(cpu_before, server.cpu_seconds())
                    level[name] = summarize(name, f"c={concurrency}", done.outcomes, done.wall_s,
                                            cpu_s=cpu_s, client=options.clients[0])  # fmt: skip
            for name, summary in level.items():
                rows[name].append(summary)
                progress(
                    f"{name} c={concurrency} ({summary.client}): "
                    f"{summary.requests_per_s:.0f} requests/s, mean {summary.mean_s * 1e3:.2f} "
                    f"ms, server CPU {summary.cpu_ms_per_input:.2f} ms/request"
                )
    return rows[NOOP], rows.get(BARE, [])


def wrk_in_turn(
    servers: dict[str, Replica], body: bytes, connections: int, duration_s: float
) -> dict[str, LoadSummary]:
    """Each server under wrk for about ``duration_s`` in all, in rounds of ``WRK_ROUND_S``
    taking turns, so that a change in the host's speed meanwhile falls on each alike."""
    num_rounds = max(1, round(duration_s / WRK_ROUND_S))
    round_s = max(1, round(duration_s / num_rounds))  # wrk takes whole seconds
    runs: dict[str, list[wrk.WrkResult]] = {name: [] for name in servers}
    cpu: dict[str, list[float | None]] = {name: [] for name in servers}
    for _ in range(num_rounds):
        for name, server in servers.items():
            cpu_before = server.cpu_seconds()
            runs[name].append(wrk.run_wrk(f"{server.url}/v1/infer", body,
                                          connections=connections, duration_s=round_s))  # fmt: skip
            cpu[name].append(cpu_delta(cpu_before, server.cpu_seconds()))
    return {
        name: summarize_wrk(name, wrk.merge_runs(runs[name]), cpu_s=_total(cpu[name]))
        for name in servers
    }


def _total(seconds: list[float | None]) -> float | None:
    """The sum, or None where any one could not be read."""
    return None if None in seconds else sum(s for s in seconds if s is not None)


def _short_single(singles: list[list[str]]) -> list[str]:
    """The first single-input request of a short text: wrk sends one body over and over."""
    return min(singles[:50], key=lambda r: abs(len(r[0].split()) - 12))
