"""Adaptive sizing against fixed batch sizes under one memory limit.

Each setting runs the same seeded mixed-length workload against a fresh replica started with
the same ``--memory-limit``. Fixed sizes behave as most servers do: an OOM fails the whole
batch (``--no-oom-split``). Run: ``python -m bench.memory_limit`` (loopback only, bounded).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from .servers import Replica, start_replica

WORDS = [
    "the",
    "a",
    "memory",
    "batch",
    "model",
    "token",
    "server",
    "queue",
    "latency",
    "budget",
    "probe",
    "split",
    "fast",
    "slow",
    "inference",
    "request",
    "answer",
    "vector",
    "text",
    "sentence",
    "replica",
    "nginx",
    "metric",
]


def make_workload(num_requests: int, seed: int, long_share: float = 0.1) -> list[list[str]]:
    """Short, medium and maximum-length inputs (``long_share`` of them); 1-4 per request."""
    rng = random.Random(seed)

    def text() -> str:
        kind = rng.random()
        if kind < long_share:
            words = 300  # truncated to the model's 256 tokens
        elif kind < long_share + (1 - long_share) * 0.75:
            words = rng.randint(5, 20)
        else:
            words = rng.randint(40, 100)
        return " ".join(rng.choice(WORDS) for _ in range(words))

    return [[text() for _ in range(rng.randint(1, 4))] for _ in range(num_requests)]


class RssSampler(threading.Thread):
    """The highest sum of the replicas' resident memory, sampled every 20 ms."""

    def __init__(self, *replicas: Replica) -> None:
        super().__init__(daemon=True)
        self.replicas = replicas
        self.peak_bytes = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            total = sum(replica.rss_bytes() or 0 for replica in self.replicas)
            self.peak_bytes = max(self.peak_bytes, total)


@dataclass
class Result:
    name: str
    inputs_per_s: float
    p50_s: float
    p99_s: float
    failed: int
    statuses: Counter
    oom_events: float
    peak_rss_mib: float


async def drive(
    requests: list[tuple[str, dict[str, object]]], concurrency: int
) -> tuple[list[float], Counter, int]:
    """POST each ``(url, body)`` in order with ``concurrency`` clients; the latencies, the
    status counts and the inputs answered."""
    latencies: list[float] = []
    statuses: Counter = Counter()
    ok_inputs = 0
    queue = list(reversed(requests))
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker() -> None:
            nonlocal ok_inputs
            while queue:
                url, body = queue.pop()
                started = time.perf_counter()
                response = await client.post(url, json=body)
                latencies.append(time.perf_counter() - started)
                statuses[response.status_code] += 1
                if response.status_code == 200:
                    ok_inputs += len(body["inputs"])  # type: ignore[arg-type]

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, statuses, ok_inputs


def measure(
    name: str, requests: list[tuple[str, dict[str, object]]], concurrency: int, *replicas: Replica
) -> Result:
    """Send ``requests`` closed-loop while sampling the replicas' summed RSS; the figures,
    with the OOM events the replicas counted."""
    sampler = RssSampler(*replicas)
    sampler.start()
    started = time.perf_counter()
    latencies, statuses, ok_inputs = asyncio.run(drive(requests, concurrency))
    elapsed = time.perf_counter() - started
    sampler.stop.set()
    sampler.join()
    ooms = sum(
        float(v)
        for replica in replicas
        for v in re.findall(
            r"^batchfit_oom_events_total\{.*\} (\S+)$",
            httpx.get(f"{replica.url}/metrics").text,
            re.M,
        )
    )
    latencies.sort()
    return Result(
        name=name,
        inputs_per_s=ok_inputs / elapsed,
        p50_s=statistics.median(latencies),
        p99_s=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        failed=sum(n for code, n in statuses.items() if code != 200),
        statuses=statuses,
        oom_events=ooms,
        peak_rss_mib=sampler.peak_bytes / 2**20,
    )


def run_setting(name, flags, workload, concurrency, log_dir) -> Result:
    with start_replica(flags, log_dir=log_dir / name) as replica:
        url = replica.url
        requests = [(f"{url}/v1/infer", {"inputs": text, "timeout_s": 300}) for text in workload]
        return measure(name, requests, concurrency, replica)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-limit", default="640MiB")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--fixed", default="8,32,128,512", help="fixed batch sizes to compare")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--long-share", type=float, default=0.4, help="share of inputs at the maximum length"
    )
    parser.add_argument("--log-dir", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    workload = make_workload(args.requests, args.seed, args.long_share)
    common = ["--memory-limit", args.memory_limit, "--max-wait-ms", "5"]
    # Adaptive runs with the server's default caps (items and padded tokens): within them
    # memory decides. Fixed sizes get room for a full batch of maximum-length inputs.
    settings = [("adaptive", common)]
    for size in (int(s) for s in args.fixed.split(",")):
        settings.append((
            f"fixed-{size}",
            [*common, "--sizer", "fixed", "--no-oom-split", "--max-batch-size", str(size),
             "--max-batch-tokens", str(size * 256)],
        ))  # fmt: skip
    print(f"{args.requests} requests ({sum(map(len, workload))} inputs, {args.long_share:.0%} "
          f"at the maximum length), {args.concurrency} clients, memory limit "
          f"{args.memory_limit}")  # fmt: skip
    print(f"{'setting':<12}{'inputs/s':>10}{'p50 s':>8}{'p99 s':>8}{'failed':>8}"
          f"{'OOMs':>6}{'peak RSS MiB':>14}  statuses")  # fmt: skip
    results = []
    for name, flags in settings:
        result = run_setting(name, flags, workload, args.concurrency, args.log_dir)
        results.append(result)
        print(f"{result.name:<12}{result.inputs_per_s:>10.1f}{result.p50_s:>8.2f}"
              f"{result.p99_s:>8.2f}{result.failed:>8}{result.oom_events:>6.0f}"
              f"{result.peak_rss_mib:>14.0f}  {dict(result.statuses)}", flush=True)  # fmt: skip
    clean = [r for r in results[1:] if r.failed == 0]
    if clean:
        best = max(clean, key=lambda r: r.inputs_per_s)
        ratio = results[0].inputs_per_s / best.inputs_per_s
        print(f"adaptive / best fixed that fails nothing ({best.name}): {ratio:.2f}x; "
              f"adaptive failures: {results[0].failed}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
