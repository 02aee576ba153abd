"""Streamed completions over HTTP with aiohttp: one request's chunk arrival times, a closed
loop of C streams over N requests, and a long prompt that joins a running stream.

Every load is bounded: a closed loop sends nothing new after ``max_duration_s`` and cuts the
streams still open ``drain_s`` later (their tokens so far still count); each request also
has its own ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from .sse import EventSplitter, parse_chunk
from .workload import GenRequest

COMPLETIONS = "/v1/completions"
HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True, slots=True)
class StreamOutcome:
    """One streamed request as the client saw it; times are seconds after its send.
    ``status`` 0: no answer (a transport error or a timeout). ``cut``: the level ended it."""

    index: int
    sent_s: float
    """When it was sent, in seconds after the level's start."""
    status: int
    token_times_s: tuple[float, ...] = ()
    """Arrival of each chunk that carried a token."""
    completion_tokens: int = 0
    """The usage chunk's count, else the token chunks counted."""
    prompt_tokens: int | None = None
    end_s: float = 0.0
    error: str | None = None
    finish_reason: str | None = None
    cut: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and not self.cut

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    def gaps_s(self) -> list[float]:
        """Time between tokens: the gaps between consecutive token chunks."""
        times = self.token_times_s
        return [b - a for a, b in itertools.pairwise(times)]


@dataclass(frozen=True, slots=True)
class StreamRun:
    outcomes: list[StreamOutcome]
    wall_s: float


def completion_body(
    request: GenRequest, model: str | None, *, extra: dict[str, object] | None = None
) -> bytes:
    """A streamed, greedy completion of the request's text that generates ``max_tokens``
    tokens where the server honours ``ignore_eos`` (vLLM does; ours will)."""
    body: dict[str, object] = {
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if model is not None:
        body["model"] = model
    body.update(extra or {})
    return orjson.dumps(body)


async def served_model(url: str, timeout_s: float = 10) -> str | None:
    """The first model ``GET /v1/models`` lists (None where the server lists none)."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{url}/v1/models") as response,
        ):
            if response.status != 200:
                return None
            listed = orjson.loads(await response.read()).get("data") or []
            return str(listed[0]["id"]) if listed else None
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, KeyError, TypeError):
        return None


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    *,
    index: int = 0,
    level_start: float = 0.0,
    timeout_s: float = 600.0,
    cut_at: float | None = None,
    on_token: Callable[[int], None] | None = None,
) -> StreamOutcome:
    """Send one streamed completion and time its chunks. ``cut_at`` (a ``perf_counter``
    time) ends it early as cut; ``on_token(n)`` runs as the n-th token arrives."""
    sent = time.perf_counter()
    deadline = sent + timeout_s
    cut_deadline = cut_at is not None and cut_at < deadline
    times: list[float] = []
    status, error, finish = 0, None, None
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    timed_out = False
    try:
        async with asyncio.timeout_at(_loop_time(min(deadline, cut_at or deadline))):
            async with session.post(f"{url}{COMPLETIONS}", data=body, headers=HEADERS) as resp:
                status = resp.status
                if status != 200:
                    error = (await resp.text())[:200]
                else:
                    splitter = EventSplitter()
                    async for piece in resp.content.iter_any():
                        now = time.perf_counter()
                        for data in splitter.feed(piece):
                            chunk = parse_chunk(data)
                            if chunk.error is not None:
                                error = chunk.error
                            if chunk.is_token:
                                times.append(now - sent)
                                if on_token is not None:
                                    on_token(len(times))
                            finish = chunk.finish_reason or finish
                            usage_tokens = chunk.completion_tokens or usage_tokens
                            prompt_tokens = chunk.prompt_tokens or prompt_tokens
                    for data in splitter.close():
                        chunk = parse_chunk(data)
                        error = chunk.error or error
                        usage_tokens = chunk.completion_tokens or usage_tokens
    except TimeoutError:
        timed_out = True
    except aiohttp.ClientError as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    cut = timed_out and cut_deadline
    if timed_out and not cut:
        error = f"timed out after {timeout_s:g} s"
    return StreamOutcome(
        index=index,
        sent_s=sent - level_start,
        status=status,
        token_times_s=tuple(times),
        completion_tokens=usage_tokens if usage_tokens is not None and not cut else len(times),
        prompt_tokens=prompt_tokens,
        end_s=time.perf_counter() - sent,
        error=error,
        finish_reason=finish,
        cut=cut,
    )


def _loop_time(perf_time: float) -> float:
    """A ``perf_counter`` time on the event loop's clock."""
    return asyncio.get_running_loop().time() + (perf_time - time.perf_counter())


def _session(num_connections: int) -> aiohttp.ClientSession:
    # No total timeout here: each request carries its own, and a stream may last minutes.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=num_connections),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
    )


async def closed_loop_streams(
    url: str,
    bodies: Sequence[bytes],
    *,
    concurrency: int,
    max_duration_s: float,
    drain_s: float = 60.0,
    timeout_s: float = 600.0,
) -> StreamRun:
    """``concurrency`` clients, each sending its next request as soon as its last stream
    ends, until every body was sent once or ``max_duration_s`` passed; streams still open
    ``drain_s`` after that are cut. The wall time runs to the last stream's end."""
    next_index = 0
    outcomes: list[StreamOutcome] = []
    async with _session(concurrency) as session:
        started = time.perf_counter()
        stop_sending = started + max_duration_s
        cut_at = stop_sending + drain_s

        async def one_client() -> None:
            nonlocal next_index
            while next_index < len(bodies) and time.perf_counter() < stop_sending:
                i = next_index
                next_index += 1
                outcomes.append(
                    await stream_one(
                        session,
                        url,
                        bodies[i],
                        index=i,
                        level_start=started,
                        timeout_s=timeout_s,
                        cut_at=cut_at,
                    )
                )

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    outcomes.sort(key=lambda o: o.index)
    return StreamRun(outcomes, wall)


@dataclass(frozen=True, slots=True)
class JoinOutcome:
    """A stream running alone, and a long prompt sent once it had ``join_after`` tokens."""

    first: StreamOutcome
    joined: StreamOutcome
    join_sent_s: float
    """When the long prompt was sent, in seconds after the first stream's send."""


async def join_run(
    url: str, first_body: bytes, join_body: bytes, *, join_after: int, timeout_s: float = 600.0
) -> JoinOutcome:
    """One stream; once its ``join_after``-th token arrives, a second request (a long
    prompt) is sent beside it. Both are bounded by ``timeout_s``."""
    if join_after < 1:
        raise ValueError(f"join_after must be at least 1, got {join_after}")
    reached = asyncio.Event()

    def on_token(n: int) -> None:
        if n >= join_after:
            reached.set()

    async with _session(2) as session:
        started = time.perf_counter()
        first_task = asyncio.create_task(
            stream_one(
                session,
                url,
                first_body,
                level_start=started,
                timeout_s=timeout_s,
                on_token=on_token,
            )
        )
        waiter = asyncio.create_task(reached.wait())
        try:
            await asyncio.wait({first_task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        join_sent = time.perf_counter() - started
        joined = await stream_one(
            session, url, join_body, index=1, level_start=started, timeout_s=timeout_s
        )
        first = await first_task
    return JoinOutcome(first, joined, join_sent)
