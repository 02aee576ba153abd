"""Step 4 of the GPU check: API processes in front of one engine (``--api-workers``).

The same replica with 1, 2, 4 and 8 API processes, under the same load: single-input
requests from ``wrk`` where it is installed (else the aiohttp client), first against the
no-op model (what the front end alone can carry) and then against MiniLM on the device.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from bench import wrk
from bench.loadgen import closed_loop
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


def every_worker_started(replica: Replica, num_workers: int, timeout_s: float = 120) -> None:
    """Ready says the engine and one API process are; the load waits for all of them."""
    deadline = time.monotonic() + timeout_s
    while replica.log().count("Application startup complete") < num_workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {num_workers} API processes started")
        time.sleep(0.1)


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
            requests = [[TEXT]] * 1_000_000
            cpu_before = replica.cpu_seconds()
            done = asyncio.run(closed_loop(replica.url, requests, concurrency=plan.connections,
                                           max_duration_s=plan.duration_s))  # fmt: skip
            cpu_s = (replica.cpu_seconds() or 0.0) - (cpu_before or 0.0)
            summary = summarize(plan.label, f"c={plan.connections}", done.outcomes, done.wall_s,
                                cpu_s=cpu_s)  # fmt: skip
            load = "aiohttp"
    figures = {"plan": asdict(plan), "load": load, "replica": asdict(summary)}
    figures["checks"] = {
        "no failed request": not summary.errors,
        "requests answered": summary.num_requests > 0,
    }
    figures["passed"] = all(figures["checks"].values())
    return figures


def plans(device: str, bundled: str) -> list[WorkersPlan]:
    if device.startswith("cuda"):
        found = [WorkersPlan("no-op", NOOP, n, 64, 5.0) for n in (1, 2, 4, 8)]
        found += [WorkersPlan("MiniLM float16", bundled, n, 64, 5.0, device, "float16")
                  for n in (1, 2, 4, 8)]  # fmt: skip
        return found
    # The dry run proves the step, as small and quick as it can (CI pays for it): one
    # replica of two API processes (one API process is the single-process replica, which
    # the throughput step serves already), a second of load and no warm-up.
    return [WorkersPlan("no-op", NOOP, 2, 8, 1.0, warm_s=0)]
