"""A bounded load run against a URL: a fixed number of requests from a few concurrent clients."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TEXTS = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank this morning.",
    "Batching requests makes inference on accelerators much cheaper.",
    "hello",
]


@dataclass
class Outcome:
    request_id: str
    status: int  # 0: no HTTP answer at all
    error: str = ""


@dataclass
class LoadRun:
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: dict[str, float] = field(default_factory=dict)  # request id -> start time

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]

    def oldest_in_flight_s(self) -> float:
        now = time.monotonic()
        return max((now - t for t in self.in_flight.values()), default=0.0)


async def load_run(
    url: str, *, requests: int, clients: int, prefix: str, inputs_per_request: int = 1,
    run: LoadRun | None = None,
) -> LoadRun:  # fmt: skip
    """POST /v1/infer ``requests`` times from ``clients`` concurrent clients; every request has
    its own X-Request-ID (``prefix-N``) so it can be found in Nginx's access log."""
    run = run or LoadRun()
    counter = iter(range(requests))

    async def client_loop(client: httpx.AsyncClient) -> None:
        for n in counter:
            request_id = f"{prefix}-{n}"
            body = {"inputs": [TEXTS[(n + j) % len(TEXTS)] for j in range(inputs_per_request)]}
            run.in_flight[request_id] = time.monotonic()
            try:
                response = await client.post(
                    "/v1/infer", json=body, headers={"x-request-id": request_id}
                )
                outcome = Outcome(request_id, response.status_code)
                if response.status_code != 200:
                    outcome.error = response.text[:300]
                elif response.json()["request_id"] != request_id:
                    outcome.status, outcome.error = -1, "request id did not round-trip"
            except httpx.HTTPError as exc:
                outcome = Outcome(request_id, 0, repr(exc))
            del run.in_flight[request_id]
            run.outcomes.append(outcome)

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return run


def access_log(
    path: Path, prefix: str, *, expect: int = 1, timeout_s: float = 10
) -> dict[str, dict]:
    """Nginx's JSON access log lines of one load run, by request id. Nginx writes a line
    after it has sent the response, so this polls until ``expect`` lines are there."""
    deadline = time.monotonic() + timeout_s
    while True:
        entries = {}
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["request_id"].startswith(prefix + "-"):
                entries[entry["request_id"]] = entry
        if len(entries) >= expect or time.monotonic() > deadline:
            return entries
        time.sleep(0.05)


def served_by(entry: dict) -> str:
    """The replica that gave the final answer (the last upstream Nginx tried)."""
    return entry["upstream_addr"].split(", ")[-1]


def shares(entries: dict[str, dict]) -> Counter:
    return Counter(served_by(e) for e in entries.values())
