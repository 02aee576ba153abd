"""The real server inside its own memory cgroup, under a real kernel limit.

Under a cgroup limit there is no allocation error to catch: the kernel kills the process. Each
test makes a child of this process's memory cgroup, starts the replica inside it and removes
it afterwards. The burst is 48 requests of 8 inputs (7 at the 256-token maximum, 1 short) with
the item caps lifted, so memory alone decides the batch sizes.
"""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest

from tests.cgroups import ChildCgroup, child_cgroup
from tests.reference import cosine, reference_embeddings
from tests.servers import ServerProcess, run_server

pytestmark = pytest.mark.integration

MiB = 2**20
CAPS = ("--max-batch-size", "1024", "--max-batch-tokens", "1000000", "--max-wait-ms", "50")
# Start-up limit where the test lowers it later: keeps warm-up (which plans the largest batch
# memory allows) to seconds; without one it would run 1024 x 256 tokens (4.6 GiB, minutes).
LOOSE_LIMIT = 1200 * MiB
WORDS = ["memory", "batch", "split", "token", "model", "server", "queue", "latency", "budget"]
LOADED_USAGE: list[int] = []  # a loaded, warmed-up replica's cgroup usage, once measured


def burst() -> list[list[str]]:
    """48 requests x 8 inputs from 24 long texts (cut to 256 tokens) and 12 short ones."""
    rng = random.Random(12)
    long = [" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(24)]
    short = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(12)]
    requests = []
    for i in range(48):
        inputs = [long[(7 * i + j) % len(long)] for j in range(7)]
        inputs.insert(i % 8, short[i % len(short)])
        requests.append(inputs)
    return requests


def send(url: str, requests: list[list[str]]) -> list[httpx.Response | Exception]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(
                *(client.post("/v1/infer", json={"inputs": r, "timeout_s": 300}) for r in requests),
                return_exceptions=True,
            )

    return asyncio.run(main())


def check_answers(requests, responses) -> None:
    statuses = [getattr(r, "status_code", repr(r)) for r in responses]
    assert statuses == [200] * len(requests), statuses
    texts = sorted({text for inputs in requests for text in inputs})
    expected = dict(zip(texts, reference_embeddings(texts), strict=True))
    worst = min(
        cosine(output, expected[text])
        for inputs, response in zip(requests, responses, strict=True)
        for text, output in zip(inputs, response.json()["outputs"], strict=True)
    )
    assert worst >= 0.9999, worst


def metric(scrape: str, name: str, labels: str = "") -> float | None:
    pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" ([0-9.e+-]+)"
    match = re.search(pattern, scrape)
    return float(match.group(1)) if match else None


def batch_sizes(scrape: str) -> dict[str, float]:
    """The ``batchfit_batch_size`` histogram (served batches only, not warm-up): its count,
    sum and cumulative buckets by their bound."""
    found = dict(re.findall(r'^batchfit_batch_size_bucket\{le="([^"]+)"\} (\S+)$', scrape, re.M))
    return {
        "count": metric(scrape, "batchfit_batch_size_count"),
        "sum": metric(scrape, "batchfit_batch_size_sum"),
        **{bound: float(value) for bound, value in found.items()},
    }


def serve_burst_under(
    cgroup: ChildCgroup, server: ServerProcess, limit: int, label: str
) -> list[httpx.Response | Exception]:
    """Send the burst, then check the replica lived through it within the limit."""
    requests = burst()
    started = time.perf_counter()
    responses = send(server.url, requests)
    elapsed = time.perf_counter() - started
    peak, kills, alive = cgroup.peak(), cgroup.oom_kills(), server.process.poll() is None
    print(
        f"\n{label}: limit {limit / MiB:.0f} MiB, cgroup peak {peak / MiB:.0f} MiB, "
        f"oom_kill {kills}, limit hits {cgroup.limit_hits()}, {elapsed:.1f}s "
        f"({8 * len(requests) / elapsed:.1f} inputs/s)"
    )
    assert alive and kills == 0, f"killed (oom_kill {kills}):\n{server.log()[-4000:]}"
    check_answers(requests, responses)
    # The kernel never had to hold the limit: usage stayed strictly below it.
    assert peak < limit, (peak, limit)
    scrape = httpx.get(f"{server.url}/metrics").text
    assert metric(scrape, "batchfit_oom_events_total", 'outcome="split"') == 0
    assert metric(scrape, "batchfit_oom_events_total", 'outcome="failed"') == 0
    assert metric(scrape, "batchfit_memory_limit_bytes", 'source="cgroup"') == limit
    sizes = batch_sizes(scrape)
    print(
        f"{sizes['count']:.0f} batches, {sizes['sum'] / sizes['count']:.1f} items on average; "
        f"cumulative by size: { {k: v for k, v in sizes.items() if k[0].isdigit()} }"
    )
    # Memory decided: 336 long inputs waited, yet every batch held at most 64 items.
    assert sizes["64.0"] == sizes["count"] > 0, sizes
    return responses


def test_a_limit_set_on_a_running_replica_binds_from_the_next_batch(tmp_path):
    with child_cgroup("running") as cgroup:
        cgroup.set_limit(LOOSE_LIMIT)
        with run_server(tmp_path, *CAPS, preexec=cgroup.join) as server:
            assert cgroup.pids() == [server.process.pid]
            usage = cgroup.usage()
            LOADED_USAGE.append(usage)
            limit = usage + 250 * MiB
            cgroup.set_limit(limit)
            cgroup.reset_peak()
            serve_burst_under(cgroup, server, limit, "limit set while running")


def test_a_replica_started_under_a_tight_limit_warms_up_within_it(tmp_path):
    if not LOADED_USAGE:
        with child_cgroup("measure") as cgroup:
            cgroup.set_limit(LOOSE_LIMIT)
            with run_server(tmp_path, *CAPS, preexec=cgroup.join):
                LOADED_USAGE.append(cgroup.usage())
    limit = LOADED_USAGE[0] + 300 * MiB
    with child_cgroup("tight") as cgroup:
        cgroup.set_limit(limit)
        with run_server(tmp_path, *CAPS, preexec=cgroup.join) as server:
            assert f"memory limit: {limit / MiB:.0f} MiB (cgroup {cgroup.path})" in server.log()
            cgroup.reset_peak()
            serve_burst_under(cgroup, server, limit, "limit set before start-up")


def test_the_same_burst_without_the_memory_term_is_killed_by_the_kernel(tmp_path):
    """The burst must be too big for the room, or the two tests above prove nothing: fixed
    batches (128 items; lifting the caps further makes its warm-up take minutes) under the
    same limit get the replica OOM-killed."""
    with child_cgroup("fixed") as cgroup:
        cgroup.set_limit(LOOSE_LIMIT)
        flags = ("--sizer", "fixed", "--max-batch-size", "128", "--max-batch-tokens", "40000")
        with run_server(tmp_path, *flags, "--max-wait-ms", "50", preexec=cgroup.join) as server:
            cgroup.set_limit(cgroup.usage() + 250 * MiB)
            responses = send(server.url, burst())
            server.process.wait(30)
            assert server.process.returncode == -9, server.log()[-4000:]
            assert cgroup.oom_kills() >= 1
            assert any(not isinstance(r, httpx.Response) for r in responses)
