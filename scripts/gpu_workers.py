"""Step 4 of the GPU check: API processes in front of one engine (``--api-workers``).

The same replica with 1, 2, 4 and 8 API processes, under the same load: single-input
requests from ``wrk`` where it is installed, else from the aiohttp client in several
processes (one process of it carried at most about 6,800 requests a second on an H200 host,
which may be below what four API processes answer), first against the no-op model (what the
front end alone can carry) and then against MiniLM on the device.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from bench import wrk
from bench.loadgen import Outcome, closed_loop
from bench.servers import Replica, start_replica
from bench.stats import LoadSummary, summarize, summarize_wrk

NOOP = "python:bench.noop:create"
TEXT = "Batching requests makes inference on accelerators much cheaper."


@dataclass(frozen=True, slots=True)
class WorkersPlan:
    label: str
    model: str
    api_workers: int
    connections: int
    duration_s: float
    device: str = "cpu"
    dtype: str = "auto"
    warm_s: int = 1
    """A first run of the load, not counted (0: none)."""
    client_processes: int = 1
    """Processes of the aiohttp client, the connections shared among them (without wrk)."""


def every_worker_started(replica: Replica, num_workers: int, timeout_s: float = 120) -> None:
    """Ready says the engine and one API process are; the load waits for all of them."""
    deadline = time.monotonic() + timeout_s
    while replica.log().count("Application startup complete") < num_workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {num_workers} API processes started")
        time.sleep(0.1)


RunPart = tuple[list[Outcome], float]
_together: Any = None
"""In a client process: the barrier every client process and the check meet at."""


def _meet(barrier: Any) -> None:
    global _together
    _together = barrier


def _client(url: str, connections: int, warm_s: float, duration_s: float) -> RunPart:
    """One client process's share of the load: warm-up, then, once every share and the check
    are at the barrier, the counted run."""
    requests = [[TEXT]] * 1_000_000
    if warm_s:
        asyncio.run(closed_loop(url, requests, concurrency=connections, max_duration_s=warm_s))
    if _together is not None:
        _together.wait()
    done = asyncio.run(closed_loop(url, requests, concurrency=connections,
                                   max_duration_s=duration_s))  # fmt: skip
    return done.outcomes, done.wall_s


def aiohttp_load(
    replica: Replica, connections: int, warm_s: float, duration_s: float, processes: int
) -> tuple[list[Outcome], float, float]:
    """Every counted outcome of ``connections`` closed-loop clients in ``processes``
    processes, the longest wall time of them, and the replica's CPU seconds meanwhile."""
    if processes <= 1:
        if warm_s:
            _client(replica.url, connections, 0.0, warm_s)
        cpu_before = replica.cpu_seconds()
        outcomes, wall_s = _client(replica.url, connections, 0.0, duration_s)
        return outcomes, wall_s, (replica.cpu_seconds() or 0.0) - (cpu_before or 0.0)
    shares = [connections // processes + (i < connections % processes) for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    together = context.Barrier(processes + 1)
    with ProcessPoolExecutor(processes, context, _meet, (together,)) as pool:
        parts = [pool.submit(_client, replica.url, share, warm_s, duration_s) for share in shares]
        together.wait(timeout=120)
        cpu_before = replica.cpu_seconds()
        done = [part.result() for part in parts]
        cpu_s = (replica.cpu_seconds() or 0.0) - (cpu_before or 0.0)
    return [o for outcomes, _ in done for o in outcomes], max(wall for _, wall in done), cpu_s


def run_workers(plan: WorkersPlan, log_dir: Path) -> dict[str, Any]:
    # INFO, after the bench's WARNING: each API process says when it has started.
    flags = ["--model", plan.model, "--api-workers", str(plan.api_workers),
             "--max-queue-items", "100000", "--log-level", "info", "--no-access-log"]  # fmt: skip
    if plan.model != NOOP:
        flags += ["--device", plan.device, "--dtype", plan.dtype]
    body = orjson.dumps({"inputs": [TEXT]})
    with start_replica(flags, log_dir=log_dir, ready_timeout_s=300) as replica:
        every_worker_started(replica, plan.api_workers)
        url = f"{replica.url}/v1/infer"
        summary: LoadSummary
        if wrk.available():
            if plan.warm_s:
                wrk.run_wrk(url, body, connections=plan.connections, duration_s=plan.warm_s)
            cpu_before = replica.cpu_seconds()
            run = wrk.run_wrk(url, body, connections=plan.connections, duration_s=plan.duration_s)
            cpu_s = (replica.cpu_seconds() or 0.0) - (cpu_before or 0.0)
            summary = summarize_wrk(plan.label, run, cpu_s=cpu_s)
            load = "wrk"
        else:
            processes = plan.client_processes
            outcomes, wall_s, cpu_s = aiohttp_load(replica, plan.connections, plan.warm_s,
                                                   plan.duration_s, processes)  # fmt: skip
            summary = summarize(plan.label, f"c={plan.connections}", outcomes, wall_s,
                                cpu_s=cpu_s)  # fmt: skip
            load = "aiohttp" if processes <= 1 else f"aiohttp x{processes}"
    figures = {"plan": asdict(plan), "load": load, "replica": asdict(summary)}
    figures["checks"] = {
        "no failed request": not summary.errors,
        "requests answered": summary.num_requests > 0,
    }
    figures["passed"] = all(figures["checks"].values())
    return figures


def plans(device: str, bundled: str) -> list[WorkersPlan]:
    if device.startswith("cuda"):
        found = [WorkersPlan("no-op", NOOP, n, 64, 5.0, client_processes=4) for n in (1, 2, 4, 8)]
        found += [WorkersPlan("MiniLM float16", bundled, n, 64, 5.0, device, "float16",
                              client_processes=4) for n in (1, 2, 4, 8)]  # fmt: skip
        return found
    # The dry run proves the step, as small and quick as it can (CI pays for it): one
    # replica of two API processes (one API process is the single-process replica, which
    # the throughput step serves already), a second of load and no warm-up.
    return [WorkersPlan("no-op", NOOP, 2, 8, 1.0, warm_s=0)]
