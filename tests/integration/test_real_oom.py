"""Real allocation failures on CPU: the real server under a real memory limit.

``--memory-limit`` caps the budget and sets RLIMIT_AS once the model is loaded, so a batch
too large for the room left gets torch's real "can't allocate memory" error. Both tests send
the same burst with the same caps; only the sizer differs, so the fixed sizer's OOMs show that
the burst does not fit, and the adaptive sizer must plan around them without a single one.
"""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest

from models.spec import BUNDLED_MODEL
from tests.reference import cosine, reference_embeddings
from tests.servers import run_server

pytestmark = pytest.mark.integration

MODEL = f'model="{BUNDLED_MODEL}"'

MEMORY_LIMIT = 640 * 2**20
# The first line of torch's CPU allocator error (c10/core/impl/alloc_cpu.cpp), as in
# "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory:
# you tried to allocate 37748736 bytes. Error code 12 (Cannot allocate memory)".
TORCH_CPU_OOM = re.compile(
    r"(\[enforce fail at alloc_cpu\.cpp:\d+\] err == 0\. )?DefaultCPUAllocator: can't allocate "
    r"memory: you tried to allocate [1-9]\d* bytes\. Error code 12 \(Cannot allocate memory\)"
)
CAPS = ("--max-batch-size", "128", "--max-batch-tokens", "40000", "--max-wait-ms", "200")
WORDS = [
    "memory",
    "batch",
    "split",
    "token",
    "model",
    "server",
    "queue",
    "latency",
    "budget",
    "probe",
]


def burst_texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    # Long inputs batch together (the planner keeps lengths alike): 96 x 256 tokens need more
    # than the room the limit leaves, so fixed batches of up to 128 must run out of memory.
    long = [" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(96)]  # truncated: 256
    short = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))) for _ in range(32)]
    texts = long + short
    rng.shuffle(texts)
    return texts


def metric(scrape: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" ([0-9.e+-]+)"
    match = re.search(pattern, scrape)
    assert match, f"{name}{{{labels}}} not in scrape"
    return float(match.group(1))


def send_burst(url: str, texts: list[str]) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            requests = [
                # A generous deadline: the point is who fails, not how fast a shared CPU is.
                client.post("/v1/infer", json={"inputs": texts[i : i + 4], "timeout_s": 300})
                for i in range(0, len(texts), 4)
            ]
            return await asyncio.gather(*requests)

    return asyncio.run(main())


def check_answers(texts, responses):
    assert [r.status_code for r in responses] == [200] * len(responses), [
        r.text for r in responses if r.status_code != 200
    ]
    outputs = [out for r in responses for out in r.json()["outputs"]]
    expected = reference_embeddings(texts)
    worst = min(cosine(a, b) for a, b in zip(outputs, expected, strict=True))
    assert worst >= 0.9999, worst


def test_fixed_batches_too_big_for_the_limit_are_split_and_nobody_fails(tmp_path):
    texts = burst_texts(seed=1)
    with run_server(
        tmp_path, "--sizer", "fixed", *CAPS, "--memory-limit", str(MEMORY_LIMIT)
    ) as server:
        responses = send_burst(server.url, texts)
        check_answers(texts, responses)
        scrape = httpx.get(f"{server.url}/metrics").text
        assert metric(scrape, "batchfit_oom_events_total", f'{MODEL},outcome="split"') > 0
        assert metric(scrape, "batchfit_oom_events_total", f'{MODEL},outcome="failed"') == 0
        # Each split was torch's own allocator failing a real allocation, as it reached the
        # model layer (which keeps its first line), not an OOM some layer made up.
        splits = re.findall(r"ran out of memory \((.*)\); splitting$", server.log(), re.M)
        assert splits, server.log()
        for message in splits:
            assert TORCH_CPU_OOM.fullmatch(message), message
        # Still serving and still ready afterwards.
        assert httpx.post(f"{server.url}/v1/infer", json={"inputs": "after"}).status_code == 200
        assert httpx.get(f"{server.url}/health/ready").status_code == 200


def test_adaptive_sizer_under_the_same_limit_runs_out_of_memory_never(tmp_path):
    texts = burst_texts(seed=1)
    with run_server(tmp_path, *CAPS, "--memory-limit", str(MEMORY_LIMIT)) as server:
        responses = send_burst(server.url, texts)
        check_answers(texts, responses)
        # One more batch: its dispatch reads VmHWM, folding in the burst's last batch.
        assert httpx.post(f"{server.url}/v1/infer", json={"inputs": "after"}).status_code == 200
        scrape = httpx.get(f"{server.url}/metrics").text
        assert metric(scrape, "batchfit_oom_events_total", f'{MODEL},outcome="split"') == 0
        assert metric(scrape, "batchfit_oom_events_total", f'{MODEL},outcome="failed"') == 0
        # The kernel's own high-water mark of resident memory since start (VmHWM, kept across
        # the per-batch resets): model load, warm-up and the whole burst.
        peak = metric(scrape, "batchfit_host_resident_peak_bytes")
        print(f"\npeak RSS {peak / 2**20:.0f} MiB under --memory-limit {MEMORY_LIMIT >> 20} MiB")
        # NOTE: VmHWM also counts memory outside any batch (thread stacks, the allocator's
        # arenas, requests being parsed): the sizer's headroom must cover it, with no slack.
        assert peak <= MEMORY_LIMIT, peak
        assert metric(scrape, "batchfit_memory_limit_bytes", 'source="flag"') == MEMORY_LIMIT
        assert httpx.get(f"{server.url}/health/ready").status_code == 200
