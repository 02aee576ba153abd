"""A generator under a real kernel memory limit: real Gemma-3-270m, the bundled embedder and a
tiny cross-encoder in one replica, inside a child memory cgroup whose limit stands 300 MiB
above the loaded replica. Under a cgroup limit the kernel kills instead of failing an
allocation, so every decision is taken before the step, from the live reading.

- A sibling process in the same cgroup grows to 200 MiB while 12 greedy streams run: the
  newest sequences are preempted and resume, none is lost, nothing is killed, and every
  stream equals transformers' ``generate`` on its prompt.
- Then a burst to each of the three models at once, under the same limit: 0 failures.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.cgroup_limit import scrape_value
from bench.generate.memory import SIBLING_CODE
from models.spec import BUNDLED_MODEL
from models.testing import save_tiny_model
from tests.cgroups import child_cgroup
from tests.integration.test_generation import (
    TEMPLATE,
    differs,
    gemma_gguf,
    greedy_outputs,
    reference_gemma,
)
from tests.servers import run_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parent.parent.parent
MiB = 2**20
GEN, EMB, RR = "gemma", "minilm", "rr"
STREAMS = 12
PROMPT_TOKENS = [180 + 17 * i for i in range(STREAMS)]
MAX_TOKENS = 32
ROOM = 300 * MiB
"""The limit stands this far above the loaded, warmed-up replica."""
SIBLING = 200 * MiB
LOOSE = 8 * 2**30
"""While the replica loads and warms up."""


@pytest.fixture(scope="module")
def reference():
    tokenizer, module = reference_gemma()
    ids = tokenizer((ROOT / "docs/design.md").read_text(), add_special_tokens=False)["input_ids"]
    prompts = [
        [tokenizer.bos_token_id, *ids[53 * i : 53 * i + n - 1]] for i, n in enumerate(PROMPT_TOKENS)
    ]
    return tokenizer, prompts, greedy_outputs(module, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """The three models in one replica in a fresh memory cgroup; the limit is set to the
    resident usage (less the page cache) plus ``ROOM`` once it is ready."""
    root = tmp_path_factory.mktemp("generation-memory")
    reranker = save_tiny_model(root / "rr", task="rerank", seed=2)
    with child_cgroup("generation") as cgroup:
        cgroup.set_limit(LOOSE)
        with run_server(
            root, "--model", f"{GEN}={gemma_gguf()}", "--model", f"{EMB}={BUNDLED_MODEL}",
            "--model", f"{RR}={reranker}", "--chat-template", str(TEMPLATE),
            "--max-wait-ms", "20", ready_timeout_s=600, preexec=cgroup.join,
        ) as server:  # fmt: skip
            # Above what it holds, not above the files it read (the kernel would drop those
            # first, and a sibling would then find room that was never the cache's).
            limit = cgroup.resident() + ROOM
            cgroup.set_limit(limit)
            cgroup.reset_peak()
            yield server, cgroup, limit


async def stream_completion(client: httpx.AsyncClient, prompt: list[int]) -> str:
    """One streamed greedy completion's text; fails on an error event."""
    body = {"model": GEN, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    parts = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            assert "error" not in chunk, chunk
            parts.append(chunk["choices"][0]["text"])
    return "".join(parts)


def generation_counter(scrape: str, name: str, labels: str = "") -> float:
    return scrape_value(scrape, name, f'model="{GEN}"' + (f",{labels}" if labels else ""))


def test_a_sibling_taking_memory_mid_stream_preempts_and_nothing_is_lost(replica, reference):
    server, cgroup, limit = replica
    tokenizer, prompts, outputs = reference

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=900) as client:
            tasks = [asyncio.create_task(stream_completion(client, p)) for p in prompts]
            # The sibling arrives once the streams are under way.
            deadline = time.monotonic() + 300
            while True:
                scrape = (await client.get("/metrics")).text
                if generation_counter(scrape, "batchfit_generation_generated_tokens_total") >= 24:
                    break
                assert time.monotonic() < deadline, "no stream got going"
                await asyncio.sleep(0.2)
            sibling = subprocess.Popen(
                [sys.executable, "-c", SIBLING_CODE, str(SIBLING)], stdout=subprocess.PIPE,
                preexec_fn=cgroup.join,
            )  # fmt: skip
            try:
                assert sibling.stdout.readline().strip() == b"held"
                return await asyncio.gather(*tasks, return_exceptions=True), sibling
            finally:
                sibling.kill()
                sibling.wait()
                sibling.stdout.close()

    texts, sibling = asyncio.run(main())
    failures = [t for t in texts if not isinstance(t, str)]
    peak, kills = cgroup.peak(), cgroup.oom_kills()
    scrape = httpx.get(f"{server.url}/metrics").text
    preempted = generation_counter(scrape, "batchfit_generation_preemptions_total",
                                   'reason="memory"')  # fmt: skip
    resumed = generation_counter(scrape, "batchfit_generation_resumed_sequences_total")
    print(
        f"\nlimit {limit / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB, oom_kill {kills}, "
        f"preempted {preempted:.0f}, resumed {resumed:.0f}, sibling exit {sibling.returncode}"
    )
    assert server.process.poll() is None and kills == 0, server.log()[-4000:]
    assert not failures, failures
    # The cgroup's peak is printed, not asserted: its usage counts page cache, which the
    # kernel reclaims at the limit; what must not happen is a kill.
    assert preempted >= 1 and resumed >= 1, "the sibling put no pressure on the cache"
    differing = sum(
        differs(tokenizer, text, tokens, gaps)
        for text, (tokens, gaps) in zip(texts, outputs, strict=True)
    )
    print(f"{differing} of {len(prompts)} streams depart from generate, each at a tie")
    assert differing <= 2


def test_a_generator_an_embedder_and_a_reranker_take_a_burst_under_one_limit(replica, reference):
    server, cgroup, limit = replica
    _, prompts, _ = reference
    documents = [f"document {i} about rivers, bridges and the market town" for i in range(16)]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=900) as client:
            calls = [stream_completion(client, p) for p in prompts[:8]]
            for i in range(24):
                calls.append(client.post("/v1/embeddings", json={
                    "model": EMB, "input": [f"{d} {i}" for d in documents]}))  # fmt: skip
                calls.append(client.post("/v1/rerank", json={
                    "model": RR, "query": f"which river {i}", "documents": documents}))  # fmt: skip
            return await asyncio.gather(*calls, return_exceptions=True)

    cgroup.reset_peak()
    answers = asyncio.run(main())
    texts, others = answers[:8], answers[8:]
    assert all(isinstance(t, str) and t for t in texts), texts
    statuses = [getattr(r, "status_code", repr(r)) for r in others]
    assert statuses == [200] * len(others), [getattr(r, "text", r) for r in others][:3]
    peak, kills = cgroup.peak(), cgroup.oom_kills()
    print(f"\nburst to three models: peak {peak / MiB:.0f} MiB of {limit / MiB:.0f}, "
          f"oom_kill {kills}")  # fmt: skip
    assert server.process.poll() is None and kills == 0, server.log()[-4000:]
