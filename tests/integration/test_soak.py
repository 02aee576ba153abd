"""Soak: thousands of mixed requests (sizes, priorities, disconnects, bad input) against the
real replica; afterwards nothing is left behind and resident memory has stopped growing."""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.reference import reference_embeddings
from tests.servers import run_server

pytestmark = pytest.mark.integration

NUM_REQUESTS = int(os.environ.get("SOAK_REQUESTS", "2000"))
NUM_WARM_UP = 1000
CONCURRENCY = 32
# The soak runs in chunks of RSS_CHUNK requests; resident memory is read whenever the replica
# is idle between them (a batch in flight holds tens of MiB of activations), once it has
# handed its free heap memory back (--memory-release-idle-s, malloc_trim), and its
# least-squares slope over the soak, after SETTLE_REQUESTS, bounded. Without the release an
# idle reading also counts the free blocks glibc keeps in its arenas, which batches of many
# shapes (n inputs x L tokens) leave behind in steps of 10-35 MiB at random points: over
# 6000 requests the bytes in use stayed at 153 MiB while idle RSS wandered from 592 to 615
# MiB, and clean runs read up to +36 MiB per 1,000 requests from such steps alone (CI: +22).
# Released, clean runs read -0.5 to +2.3. The soak admits about 3.2 inputs a request (2.4
# answered), so a leak of 4 KiB an admitted input (12.5 MiB per 1,000 requests; +12 and +13
# measured) is above the bound, and 12 KiB (+37 measured) far above; leaked futures, tasks
# and queue entries are checked exactly.
RSS_CHUNK = 250
SETTLE_REQUESTS = 500
# Long enough that 32 clients in a loop leave no such gap within a chunk: the release a
# reading waits for (one that happened after the chunk began) is the one after it.
RELEASE_IDLE_S = 0.5
MAX_RSS_SLOPE_MIB_PER_1000 = 10.0

WORDS = [
    "batch",
    "queue",
    "memory",
    "token",
    "model",
    "server",
    "replica",
    "latency",
    "budget",
    "padding",
    "request",
    "answer",
    "cat",
    "mat",
    "fox",
    "dog",
    "river",
    "mountain",
    "library",
    "embedding",
    "vector",
    "search",
    "cluster",
    "sentence",
]

BAD_CASES = [
    (b'{"inputs": [', 400, "invalid_json"),
    (b'{"inputs": ""}', 400, "empty_input"),
    (b'{"inputs": []}', 400, "empty_input"),
    (b'{"inputs": [1, 2]}', 422, "invalid_request"),
    (b'{"inputs": null}', 422, "invalid_request"),
    (b'{"inputs": "caf\xe9"}', 400, "invalid_json"),
    (b'{"inputs": "\\ud800"}', 422, "invalid_request"),
    (b'{"input": "typo"}', 422, "invalid_request"),
    (b'{"inputs": "a", "timeout_s": -1}', 422, "invalid_request"),
    (b'{"inputs": "a", "priority": 1000}', 422, "invalid_request"),
    (b'{"inputs": "a", "timeout_s": 1e-9}', 504, "deadline_exceeded"),
    (('{"inputs": ["x"] * 33}'.replace('["x"] * 33', str(["x"] * 33).replace("'", '"'))).encode(),
     413, "too_many_inputs"),
    (('{"inputs": "' + "word " * 300 + '", "truncate": false}').encode(), 413, "input_too_long"),
]  # fmt: skip


def text_pool(rng: random.Random) -> list[str]:
    lengths = [1, 2, 3, 5, 8, 12, 16, 24, 32, 40, 48, 60]
    return [" ".join(rng.choice(WORDS) for _ in range(n)) + f" #{i}" for i, n in
            enumerate(lengths * 2)]  # fmt: skip


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def value(text: str, name: str) -> float:
    """``name``'s sample, summed over the ``model`` label where it has one."""
    found = re.findall(
        rf'^{re.escape(name)}(?:{{model="[^"]*"}})? ([0-9.e+-]+)$', text, re.MULTILINE
    )
    assert found, f"{name} not in scrape"
    return sum(float(v) for v in found)


def wait_idle(url: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(url)
        idle = all(value(text, name) == 0 for name in (
            "batchfit_queue_depth", "batchfit_open_items", "batchfit_active_infer_requests",
        ))  # fmt: skip
        if idle:
            return text
        assert time.monotonic() < deadline, "the replica did not return to idle"
        time.sleep(0.05)


def released_rss_bytes(url: str, pid: int, since_s: float, timeout_s: float = 30.0) -> int:
    """RSS once the idle replica has handed its free heap memory back (later than
    ``since_s``, Unix time)."""
    deadline = time.monotonic() + timeout_s
    name = "batchfit_host_heap_last_release_timestamp_seconds"
    while value(wait_idle(url), name) < since_s:
        assert time.monotonic() < deadline, "the idle replica did not release its free memory"
        time.sleep(0.05)
    return rss_bytes(pid)


def rss_slope_mib_per_1000(samples: list[tuple[int, int]]) -> float:
    """Least-squares slope of RSS (bytes) against requests done, in MiB per 1,000 requests."""
    done, rss = np.asarray(samples, dtype=np.float64).T
    return float(np.polyfit(done, rss, 1)[0]) * 1000 / 2**20


async def drive(url: str, num: int, seed: int, pool: list[str], reference: dict) -> Counter:
    rng = random.Random(seed)
    plan = []
    for _ in range(num):
        roll = rng.random()
        if roll < 0.6:
            plan.append(("good", rng.sample(pool, rng.randint(1, 3)), rng.randint(-2, 2)))
        elif roll < 0.7:
            plan.append(("good", [rng.choice(pool) for _ in range(rng.randint(8, 16))], 0))
        elif roll < 0.8:
            plan.append(("disconnect", rng.sample(pool, rng.randint(4, 12)),
                         rng.uniform(0.0, 0.05)))  # fmt: skip
        else:
            plan.append(("bad", rng.choice(BAD_CASES), None))
    outcomes: Counter = Counter()
    queue = iter(plan)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            for kind, payload, extra in queue:
                if kind == "good":
                    headers = {"X-Timeout-S": "120"} if extra else {}
                    body = {"inputs": payload, "priority": extra}
                    response = await client.post("/v1/infer", json=body, headers=headers)
                    assert response.status_code == 200, response.text
                    outputs = response.json()["outputs"]
                    assert len(outputs) == len(payload)
                    for text, output in zip(payload, outputs, strict=True):
                        assert float(np.asarray(output) @ reference[text]) >= 0.999
                    outcomes["ok"] += 1
                elif kind == "disconnect":
                    try:
                        await asyncio.wait_for(
                            client.post("/v1/infer", json={"inputs": payload}), extra
                        )
                        outcomes["finished before the disconnect"] += 1
                    except TimeoutError:
                        outcomes["disconnected"] += 1
                else:
                    body, status, error_type = payload
                    response = await client.post(
                        "/v1/infer", content=body, headers={"content-type": "application/json"}
                    )
                    assert response.status_code == status, (body[:60], response.text)
                    assert response.json()["error_type"] == error_type
                    outcomes[f"bad {status}"] += 1

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return outcomes


@pytest.mark.timeout(1800)
def test_soak(tmp_path):
    rng = random.Random(7)
    pool = text_pool(rng)
    # transformers' own forward pass, truncated as the server is told to truncate.
    reference = dict(zip(pool, reference_embeddings(pool, max_length=64), strict=True))
    with run_server(
        tmp_path, "--max-input-tokens", "64", "--max-queue-items", "4096",
        "--max-inputs-per-request", "32", "--max-wait-ms", "2",
        "--memory-release-idle-s", str(RELEASE_IDLE_S),
    ) as server:  # fmt: skip
        pid = server.process.pid
        since_s = time.time()
        warm = asyncio.run(drive(server.url, NUM_WARM_UP, 1, pool, reference))
        rss = [(0, released_rss_bytes(server.url, pid, since_s))]
        before = wait_idle(server.url)
        tasks_before = value(before, "batchfit_event_loop_tasks")
        inputs_before = value(before, "batchfit_inputs_total")

        started = time.monotonic()
        soak: Counter = Counter()
        for chunk, first in enumerate(range(0, NUM_REQUESTS, RSS_CHUNK)):
            num = min(RSS_CHUNK, NUM_REQUESTS - first)
            since_s = time.time()
            soak += asyncio.run(drive(server.url, num, 2 + chunk, pool, reference))
            rss.append((first + num, released_rss_bytes(server.url, pid, since_s)))
            after = wait_idle(server.url)
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 30
        while value(after, "batchfit_event_loop_tasks") != tasks_before:
            assert time.monotonic() < deadline, "event-loop tasks did not return to baseline"
            time.sleep(0.1)
            after = scrape(server.url)
        log = server.log()

    cancelled = sum(
        value(after, f'batchfit_cancelled_items_total{{stage="{stage}"}}')
        for stage in ("queued", "running")
    )
    settled = [(done, b) for done, b in rss if done >= SETTLE_REQUESTS]
    slope = rss_slope_mib_per_1000(settled)
    inputs = value(after, "batchfit_inputs_total") - inputs_before
    print(
        f"\nsoak: {NUM_REQUESTS} requests ({inputs:.0f} inputs answered) in {elapsed:.1f}s: "
        f"{dict(soak)}; warm-up {dict(warm)}\nreleased idle RSS every {RSS_CHUNK} requests after "
        f"warm-up, MiB: {[round(b / 2**20) for _, b in rss]}; slope from request "
        f"{SETTLE_REQUESTS} {slope:+.2f} MiB per 1000 requests (bound "
        f"{MAX_RSS_SLOPE_MIB_PER_1000}); cancelled items {cancelled:.0f}; "
        f"event-loop tasks {tasks_before:.0f} before and after"
    )
    assert sum(soak.values()) == NUM_REQUESTS
    assert soak["disconnected"] > 0 and cancelled > 0
    assert 'code="500"' not in after
    assert len(settled) >= 4
    assert slope <= MAX_RSS_SLOPE_MIB_PER_1000
    assert "Traceback" not in log and " ERROR " not in log
