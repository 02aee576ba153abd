"""Repeated traffic: the same seeded workload against a replica with the output cache off and
with it on.

The workload is the benchmark's usual mix (75% short inputs, 20% medium, 5% near the
256-token maximum; a fifth of the requests carry 2-8 inputs), except that each input is,
with probability ``hot_share`` (30% by default), drawn from a small hot set of
``hot_size`` texts (32) instead: retrieval traffic repeats its queries and boilerplate. Both
replicas get the same requests in the same order, closed loop with ``concurrency`` clients.
``cache-off`` runs with ``--cache-bytes 0 --no-deduplicate`` (every input computed, as
without a cache), ``cache-on`` with the default bound and deduplication. Reported:
inputs/s, p50 and p99 latency, the inputs computed (forward-pass items) and the cache's hits
and deduplicated inputs.

``batchfit bench --repeated-traffic`` (or ``python -m bench.repeated``); loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from .memory_limit import drive
from .servers import start_replicas
from .workload import WorkloadSpec, make_input, make_requests


def _default_bound() -> str:
    from server.cache import default_cache_bytes, host_memory_bytes

    return str(default_cache_bytes(host_memory_bytes(None, on_host=True)))


CONFIGS = {
    "cache-off": ["--cache-bytes", "0", "--no-deduplicate"],
    "cache-on": ["--cache-bytes", _default_bound()],  # the server's default rule, on this host
}


@dataclass(frozen=True, slots=True)
class RepeatedOptions:
    requests: int = 400
    concurrency: int = 16
    hot_share: float = 0.3
    hot_size: int = 32
    seed: int = 0
    server_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.hot_share <= 1 or self.hot_size < 1:
            raise ValueError("need 0 <= hot_share <= 1 and hot_size >= 1")
        if self.requests < 1 or self.concurrency < 1:
            raise ValueError("need at least one request and one client")


@dataclass(frozen=True, slots=True)
class RepeatedResult:
    config: str
    inputs: int
    inputs_per_s: float
    p50_ms: float
    p99_ms: float
    computed_inputs: int
    computed_tokens: int
    cache_hits: int
    deduplicated_inputs: int
    failed_requests: int


def repeated_requests(options: RepeatedOptions) -> list[list[str]]:
    """The usual seeded mix with ``hot_share`` of its inputs from a hot set; pure."""
    spec = WorkloadSpec(seed=options.seed)
    rng = random.Random(f"{options.seed}:hot")
    hot = [make_input(rng, spec.bands) for _ in range(options.hot_size)]
    requests = make_requests(spec, options.requests)
    return [
        [rng.choice(hot) if rng.random() < options.hot_share else text for text in request]
        for request in requests
    ]


def _counters(url: str) -> dict[str, float]:
    wanted = (
        "batchfit_batch_size_sum", "batchfit_batch_real_tokens_total",
        "batchfit_cache_hits_total", "batchfit_deduplicated_inputs_total",
    )  # fmt: skip
    found = dict.fromkeys(wanted, 0.0)
    for name, value in re.findall(
        r"^(\w+)\{[^}]*\} (\S+)$", httpx.get(f"{url}/metrics").text, re.M
    ):
        if name in found:
            found[name] += float(value)
    return found


def run_config(name: str, options: RepeatedOptions, requests: list[list[str]]) -> RepeatedResult:
    flags = [*CONFIGS[name], *options.server_flags]
    with start_replicas([flags], ready_timeout_s=300) as (replica,):
        # Warm the server's code paths on inputs the workload never sends.
        warm = [[f"warm-up input number {i}"] for i in range(8)]
        asyncio.run(drive([(f"{replica.url}/v1/infer", {"inputs": w}) for w in warm], 4))
        before = _counters(replica.url)
        bodies = [(f"{replica.url}/v1/infer", {"inputs": r, "timeout_s": 300}) for r in requests]
        started = time.perf_counter()
        latencies, statuses, ok_inputs = asyncio.run(drive(bodies, options.concurrency))
        elapsed = time.perf_counter() - started
        after = _counters(replica.url)
    latencies.sort()
    change = {k: int(after[k] - before[k]) for k in after}
    return RepeatedResult(
        config=name,
        inputs=ok_inputs,
        inputs_per_s=round(ok_inputs / elapsed, 1),
        p50_ms=round(statistics.median(latencies) * 1000, 1),
        p99_ms=round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000, 1),
        computed_inputs=change["batchfit_batch_size_sum"],
        computed_tokens=change["batchfit_batch_real_tokens_total"],
        cache_hits=change["batchfit_cache_hits_total"],
        deduplicated_inputs=change["batchfit_deduplicated_inputs_total"],
        failed_requests=sum(n for status, n in statuses.items() if status != 200),
    )


def report(options: RepeatedOptions, results: list[RepeatedResult], command: str) -> str:
    by_name = {r.config: r for r in results}
    lines = [
        "# Repeated traffic: the output cache off and on",
        "",
        f"`{command}`: {options.requests} requests, {options.concurrency} clients, "
        f"{options.hot_share:.0%} of inputs from a hot set of {options.hot_size} texts, "
        f"seed {options.seed}.",
        "",
        "| config | inputs/s | p50 ms | p99 ms | inputs computed | tokens computed | cache hits "
        "| deduplicated | failed requests |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.config} | {r.inputs_per_s} | {r.p50_ms} | {r.p99_ms} | {r.computed_inputs} "
            f"of {r.inputs} | {r.computed_tokens} | {r.cache_hits} | {r.deduplicated_inputs} "
            f"| {r.failed_requests} |"
        )
    if "cache-on" in by_name and "cache-off" in by_name and by_name["cache-off"].inputs_per_s:
        ratio = by_name["cache-on"].inputs_per_s / by_name["cache-off"].inputs_per_s
        lines += ["", f"cache on / off, inputs/s: {ratio:.2f}"]
    return "\n".join(lines) + "\n"


def run_repeated(options: RepeatedOptions, out: Path, command: str) -> list[RepeatedResult]:
    requests = repeated_requests(options)
    results = [run_config(name, options, requests) for name in CONFIGS]
    out.mkdir(parents=True, exist_ok=True)
    (out / "repeated.md").write_text(report(options, results, command))
    (out / "repeated.json").write_text(
        json.dumps({"options": asdict(options), "results": [asdict(r) for r in results]}, indent=2)
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.repeated", description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--hot-share", type=float, default=0.3)
    parser.add_argument("--hot-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-report"))
    parser.add_argument("--server-flag", action="append", default=[], dest="server_flags")
    args = parser.parse_args(argv)
    options = RepeatedOptions(
        requests=args.requests, concurrency=args.concurrency, hot_share=args.hot_share,
        hot_size=args.hot_size, seed=args.seed, server_flags=tuple(args.server_flags),
    )  # fmt: skip
    command = "python -m bench.repeated " + " ".join(sys.argv[1:] if argv is None else argv)
    run_repeated(options, args.out, command.strip())
    print((args.out / "repeated.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
