"""Load generators over HTTP: closed loop (C clients, N requests) and open loop (arrivals at
given times for a fixed duration). Both are bounded in count and time and stop by themselves.

The benchmark's own client is aiohttp: measured against a no-op model on this 2-core host it
costs 0.7 ms less per request than httpx's async client (1.3 vs 2.0 ms one-client round
trip), CPU that the client would otherwise take from the server it measures. ``client="httpx"``
drives the same load with httpx's ``AsyncClient``, as many Python applications would: a
server's defaults have to hold for clients other than the benchmark's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
import httpx
import orjson

CLIENTS = ("aiohttp", "httpx")
Post = Callable[[bytes], Awaitable[int]]
"""Sends one body; returns the status, 0 for a transport error or a timeout."""
IN_TURN = "c=1, in turn"
"""The load ``in_turn`` puts on each server: one client, whose requests alternate between them."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the client saw it. ``status`` 0 means a transport error or a timeout."""

    sent_s: float
    latency_s: float
    status: int
    num_inputs: int


@dataclass(frozen=True, slots=True)
class RunResult:
    outcomes: list[Outcome]
    wall_s: float


def encode_bodies(requests: Sequence[Sequence[str]]) -> list[bytes]:
    """Bodies are encoded before the clock starts, so the client spends less CPU under load.
    A request repeated as the same object (``[inputs] * n``, a load without an end) is
    encoded once: a million encodings took 3 s of a 2-CPU host, per run and client process."""
    encoded: dict[int, tuple[Sequence[str], bytes]] = {}  # each request held: ids stay unique
    bodies = []
    for inputs in requests:
        seen = encoded.get(id(inputs))
        if seen is None:
            seen = encoded[id(inputs)] = (inputs, orjson.dumps({"inputs": list(inputs)}))
        bodies.append(seen[1])
    return bodies


HEADERS = {"content-type": "application/json"}


@contextlib.asynccontextmanager
async def _client(
    kind: str, url: str, num_connections: int, timeout_s: float
) -> AsyncIterator[Post]:
    if kind == "aiohttp":
        async with aiohttp.ClientSession(
            base_url=url,
            connector=aiohttp.TCPConnector(limit=num_connections),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as session:

            async def post_aiohttp(body: bytes) -> int:
                try:
                    async with session.post("/v1/infer", data=body, headers=HEADERS) as response:
                        await response.read()
                        return response.status
                except (aiohttp.ClientError, TimeoutError):
                    return 0

            yield post_aiohttp
    elif kind == "httpx":
        limits = httpx.Limits(
            max_connections=num_connections, max_keepalive_connections=num_connections
        )
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s) as client:

            async def post_httpx(body: bytes) -> int:
                try:
                    response = await client.post("/v1/infer", content=body, headers=HEADERS)
                    return response.status_code
                except (httpx.HTTPError, TimeoutError):
                    return 0

            yield post_httpx
    else:
        raise ValueError(f"unknown client {kind!r}; expected one of {CLIENTS}")


async def _send(
    post: Post,
    body: bytes,
    num_inputs: int,
    started: float,
    scheduled: float | None = None,
) -> Outcome:
    # Open loop measures from the scheduled send time, so a slow client cannot hide queueing.
    sent = time.perf_counter() if scheduled is None else scheduled
    status = await post(body)
    return Outcome(sent - started, time.perf_counter() - sent, status, num_inputs)


async def closed_loop(
    url: str,
    requests: Sequence[Sequence[str]],
    *,
    concurrency: int,
    max_duration_s: float,
    timeout_s: float = 60.0,
    after_each: Callable[[int], None] | None = None,
    client: str = "aiohttp",
) -> RunResult:
    """``concurrency`` clients each send their next request as soon as the last one answers,
    until every request was sent once or ``max_duration_s`` passed.

    ``after_each(i)`` runs once request ``i`` answered, before the next is sent; only with
    one client, where it cannot delay another request (the idle benchmark times the model
    in-process there, at the same moments as the server). ``client`` is one of ``CLIENTS``."""
    if after_each is not None and concurrency != 1:
        raise ValueError("after_each needs concurrency 1")
    bodies = encode_bodies(requests)
    counts = [len(r) for r in requests]
    next_index = 0
    outcomes: list[Outcome] = []
    async with _client(client, url, concurrency, timeout_s) as post:
        started = time.perf_counter()
        stop_at = started + max_duration_s

        async def one_client() -> None:
            nonlocal next_index
            while next_index < len(bodies) and time.perf_counter() < stop_at:
                i = next_index
                next_index += 1
                outcomes.append(await _send(post, bodies[i], counts[i], started))
                if after_each is not None:
                    after_each(i)

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return RunResult(outcomes, wall)


async def in_turn(
    urls: Sequence[str],
    requests: Sequence[Sequence[str]],
    *,
    max_duration_s: float,
    timeout_s: float = 60.0,
    client: str = "aiohttp",
) -> list[RunResult]:
    """One client per server; each request goes to every server in turn, one at a time, the
    first of them rotating from one request to the next. So servers compared at one client
    see the same moments of a host whose speed drifts. One ``RunResult`` per url, in order,
    its wall time the time its own requests took (the time the client spent on that server)."""
    bodies = encode_bodies(requests)
    counts = [len(r) for r in requests]
    outcomes: list[list[Outcome]] = [[] for _ in urls]
    async with contextlib.AsyncExitStack() as stack:
        posts = [await stack.enter_async_context(_client(client, url, 1, timeout_s))
                 for url in urls]  # fmt: skip
        started = time.perf_counter()
        stop_at = started + max_duration_s
        for i, body in enumerate(bodies):
            if time.perf_counter() >= stop_at:
                break
            for k in range(len(urls)):
                which = (i + k) % len(urls)
                outcomes[which].append(await _send(posts[which], body, counts[i], started))
    return [RunResult(mine, sum(o.latency_s for o in mine)) for mine in outcomes]


async def open_loop(
    url: str,
    requests: Sequence[Sequence[str]],
    send_times_s: Sequence[float],
    *,
    max_connections: int = 256,
    timeout_s: float = 30.0,
    client: str = "aiohttp",
) -> RunResult:
    """Send request ``i`` at ``send_times_s[i]`` whether or not earlier ones answered (Poisson
    arrivals do not wait for the server). Stops after the last send time and at most
    ``timeout_s`` more for the answers still out."""
    if len(send_times_s) > len(requests):
        raise ValueError(f"{len(send_times_s)} send times but only {len(requests)} requests")
    bodies = encode_bodies(requests[: len(send_times_s)])
    tasks: list[asyncio.Task[Outcome]] = []
    async with _client(client, url, max_connections, timeout_s) as post:
        started = time.perf_counter()
        for i, at in enumerate(send_times_s):
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(_send(post, bodies[i], len(requests[i]), started, started + at))
            )
        outcomes = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - started
    return RunResult(outcomes, wall)
