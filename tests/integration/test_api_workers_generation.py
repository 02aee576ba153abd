"""``--api-workers 2`` serves generation: the engine streams each request's tokens to its API
process as they come, and the API process to the client.

Three replicas of one tiny random-weight Llama start together, once for the module: the one
under test (two API processes, one running sequence and two waiting at most, so that a full
queue is easy to make), a single-process one to compare its answers with, and one that a
test drains. The API process's side of the link is also driven alone, against a fake engine:
a deadline for the first event only, cancels, and a lost engine."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from bench.servers import Replica, start_replicas
from generation import SequenceSpec, TokenEvent
from models import SamplingParams
from server.disconnect import ConnectionWatch
from server.engine import remote_parts, wire
from server.errors import ApiError
from server.runtime import ClientDisconnected
from tests.generators import tiny_generator
from tests.integration.test_api_workers import children, poll
from tests.rawhttp import send_request
from tests.test_request_deadlines import MODEL, TIMEOUT, remote, until

pytestmark = pytest.mark.integration

NAME = "llama"
CONTEXT = 4096
"""The generator's context, up from the tiny model's 512: a stream can outlast what a test
does while it runs, however fast the host (each test that starts one ends it)."""
LONG = 3000
"""max_tokens of a stream that a test ends before its end."""
RUNNING = f'batchfit_generation_running_sequences{{model="{NAME}"}}'
WAITING = f'batchfit_generation_waiting_sequences{{model="{NAME}"}}'
CACHE = f'batchfit_generation_cache_bytes{{model="{NAME}"}}'
CANCELLED = f'batchfit_generation_finished_sequences_total{{model="{NAME}",reason="cancelled"}}'


@dataclass
class Replicas:
    workers: Replica
    single: Replica
    drained: Replica


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("generators")
    folder = tiny_generator(root, NAME)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (folder / "config.json").write_text(json.dumps(config))
    model = ["--model", str(folder), "--task", "generate"]
    # One sequence runs, two wait: a third is refused (429).
    workers = [*model, "--api-workers", "2", "--max-running-seqs", "1",
               "--max-queue-items", "2", "--max-inputs-per-request", "2"]  # fmt: skip
    drained = [*model, "--api-workers", "2", "--log-level", "info"]
    with start_replicas([workers, model, drained], log_dir=root / "logs") as started:
        yield Replicas(*started)


def port_of(replica: Replica) -> int:
    return int(replica.url.rsplit(":", 1)[1])


def metric(url: str, series: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search("^" + re.escape(series) + r" (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def completion(**extra) -> dict:
    return {"model": NAME, "prompt": "The quick brown fox", "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip


def first_chunk(sock: socket.socket) -> bytes:
    """What a raw streamed request has received once its first event is in."""
    received = b""
    while b"data: " not in received.partition(b"\r\n\r\n")[2]:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {received!r}"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received
    return received


def idle(url: str) -> None:
    """Wait until the engine runs nothing and its store holds nothing."""
    poll(lambda: metric(url, RUNNING) == 0 and metric(url, WAITING) == 0, 60)
    poll(lambda: metric(url, CACHE) == 0, 30)


# -- a real replica -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_equals_one_processs(replicas, stream):
    """Single prompts, and two prompts in one streamed request (two sequences, whose stream
    ends only once both have; the replica lets two wait)."""
    if stream:
        body = completion(prompt=["One two", "The quick brown fox"], max_tokens=12, stream=True)
        texts = []
        for r in (replicas.workers, replicas.single):
            with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=120) as got:
                lines = [line for line in got.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            by_choice = ["", ""]
            for line in lines[:-1]:
                choice = json.loads(line[6:])["choices"][0]
                by_choice[choice["index"]] += choice["text"]
            texts.append(by_choice)
        assert texts[0] == texts[1] and all(texts[0])
        return
    for prompt in ("The quick brown fox", [5, 17, 99, 3, 250, 41]):
        body = completion(prompt=prompt, max_tokens=24, logprobs=2)
        answers = [
            httpx.post(f"{r.url}/v1/completions", json=body, timeout=120)
            for r in (replicas.workers, replicas.single)
        ]
        for answer in answers:
            assert answer.status_code == 200, answer.text
        ours, theirs = (answer.json() for answer in answers)
        assert ours["choices"] == theirs["choices"]
        assert ours["usage"] == theirs["usage"]
        assert ours["usage"]["completion_tokens"] == 24


def chat_args(max_tokens: int) -> dict:
    return {
        "model": NAME, "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True},
    }  # fmt: skip


def expected_chat(replicas: Replicas, max_tokens: int) -> str:
    with openai.OpenAI(base_url=f"{replicas.single.url}/v1", api_key="-") as client:
        answer = client.chat.completions.create(**chat_args(max_tokens))
    return answer.choices[0].message.content


def check_chunks(chunks: list, text: str, max_tokens: int) -> None:
    *tokens, last = chunks
    assert len(tokens) > 2  # streamed in pieces
    assert tokens[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in tokens) == text
    assert [c.choices[0].finish_reason for c in tokens][-1] == "length"
    assert last.choices == [] and last.usage.completion_tokens == max_tokens


def test_a_streamed_chat_through_the_openai_client(replicas):
    text = expected_chat(replicas, 40)
    with openai.OpenAI(base_url=f"{replicas.workers.url}/v1", api_key="-", max_retries=0) as client:
        stream = client.chat.completions.create(
            **chat_args(40), stream=True, stream_options={"include_usage": True}
        )
        check_chunks(list(stream), text, 40)


async def test_a_streamed_chat_through_the_async_openai_client(replicas):
    text = await asyncio.to_thread(expected_chat, replicas, 40)
    async with openai.AsyncOpenAI(
        base_url=f"{replicas.workers.url}/v1", api_key="-", max_retries=0
    ) as client:
        stream = await client.chat.completions.create(
            **chat_args(40), stream=True, stream_options={"include_usage": True}
        )
        check_chunks([chunk async for chunk in stream], text, 40)


def test_tokens_reach_the_client_as_they_are_generated(replicas):
    max_tokens = 120
    body = completion(max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    arrivals, lines = [], []
    with httpx.Client(timeout=120) as client:
        sent_s = time.monotonic()
        with client.stream("POST", f"{replicas.workers.url}/v1/completions", json=body) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line:
                    arrivals.append(time.monotonic())
                    lines.append(line)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    # Sent as they come, the chunks spread over the generation; held to its end, they
    # would all arrive at once.
    first_s, last_s = arrivals[0], arrivals[-2]
    assert last_s - first_s > 0.5 * (last_s - sent_s), (sent_s, arrivals)


def test_a_full_queue_is_429_with_retry_after_in_openais_shape(replicas):
    url, port = replicas.workers.url, port_of(replicas.workers)
    running = send_request(
        port, json.dumps(completion(max_tokens=LONG, stream=True)).encode(),
        path="/v1/completions",
    )  # fmt: skip
    waiting = None
    try:
        first_chunk(running)
        waiting = send_request(
            port, json.dumps(completion(max_tokens=LONG, stream=True, n=2)).encode(),
            path="/v1/completions",
        )  # fmt: skip
        poll(lambda: metric(url, WAITING) == 2)
        with (
            openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as client,
            pytest.raises(openai.RateLimitError) as refused,
        ):
            client.completions.create(model=NAME, prompt="Refused", max_tokens=4)
        answer = refused.value.response
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["type"] == "rate_limit_error"
        assert refused.value.code == "overloaded"
    finally:
        if waiting is not None:
            waiting.close()
        running.close()
    idle(url)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", completion(n=9)),
        ("/v1/completions", completion(max_tokens=CONTEXT)),
        ("/v1/completions", completion(model="nobody")),
        ("/v1/completions", {"model": NAME}),
        ("/v1/chat/completions", {**chat_args(4), "tools": [{"type": "function"}]}),
    ],
)
def test_bad_requests_are_answered_as_one_process_answers_them(replicas, path, body):
    body = {key: value for key, value in body.items() if key != "extra_body"}
    ours, theirs = (
        httpx.post(f"{r.url}{path}", json=body, timeout=30)
        for r in (replicas.workers, replicas.single)
    )
    assert ours.status_code in (400, 404)
    assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json())
    assert set(ours.json()["error"]) == {"message", "type", "param", "code"}


def test_a_client_gone_mid_stream_frees_the_engines_cache(replicas):
    url = replicas.workers.url
    idle(url)
    cancelled = metric(url, CANCELLED)
    sock = send_request(
        port_of(replicas.workers), json.dumps(completion(max_tokens=LONG, stream=True)).encode(),
        path="/v1/completions",
    )  # fmt: skip
    try:
        first_chunk(sock)
        assert metric(url, RUNNING) == 1 and metric(url, CACHE) > 0
    finally:
        sock.close()
    idle(url)
    assert metric(url, CANCELLED) == cancelled + 1


def test_sigterm_lets_a_running_stream_finish(replicas):
    replica = replicas.drained
    workers = children(replica.process.pid)
    assert len(workers) == 2
    max_tokens = 300
    body = completion(max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    lines = []
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{replica.url}/v1/completions", json=body) as answer,
    ):
        assert answer.status_code == 200
        stream = answer.iter_lines()
        lines.append(next(stream))
        replica.process.send_signal(signal.SIGTERM)
        refused = httpx.post(f"{replica.url}/v1/completions", json=completion(max_tokens=4))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert metric(replica.url, RUNNING) == 1  # the drain began while it ran
        lines.extend(stream)
    lines = [line for line in lines if line]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == max_tokens
    assert replica.process.wait(60) == 0
    poll(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers))
    log = replica.log()
    assert "drained: every admitted request was answered" in log
    assert "Traceback" not in log


# -- an API process against a fake engine ---------------------------------------------------

SPECS = [SequenceSpec([1, 2, 3], 8, SamplingParams(temperature=0.0))]


def generate(r, *, timeout_s: float = 60, client=None):
    return r.runtime.generate(SPECS, model=MODEL, priority=3, timeout_s=timeout_s, client=client)


def sent(r, kind: bytes) -> list[tuple]:
    return [header for received, header in r.engine.received if received == kind]


async def next_events(run):
    async with asyncio.timeout(TIMEOUT):
        return await run.next_events()


async def test_the_engines_events_come_as_they_are_sent_until_its_end():
    async with remote() as r:
        run = generate(r)
        await until(lambda: sent(r, wire.GENERATE))
        [(number, model, priority, timeout_s)] = sent(r, wire.GENERATE)
        assert (model, priority, timeout_s) == (MODEL, 3, 60)
        events = [TokenEvent(0, "a", (7,)), TokenEvent(0, "b", (8,))]
        r.engine.link.send(wire.TOKENS, (number,), wire.dumps(events))
        assert await next_events(run) == events
        last = [TokenEvent(0, "c", (9,), finish_reason="length")]
        r.engine.link.send(wire.TOKENS, (number,), wire.dumps(last))
        r.engine.link.send(wire.END, (number,))
        assert await next_events(run) == last
        with pytest.raises(EOFError):
            await next_events(run)
        run.close()
        await r.everything_sent()
        assert sent(r, wire.CANCEL) == []  # the engine ended it


async def test_the_engines_error_is_raised_as_it_said_it():
    async with remote() as r:
        run = generate(r)
        await until(lambda: sent(r, wire.GENERATE))
        [(number, *_)] = sent(r, wire.GENERATE)
        r.engine.link.send(wire.ERROR, (number, 429, "overloaded", "full", 1.0))
        with pytest.raises(ApiError) as refused:
            await next_events(run)
        error = refused.value
        assert (error.status, error.error_type, error.retry_after_s) == (429, "overloaded", 1.0)
        run.close()
        await r.everything_sent()
        assert sent(r, wire.CANCEL) == []


async def test_closed_before_its_end_or_its_client_gone_the_engine_is_told_to_cancel():
    async with remote() as r:
        closed = generate(r)
        watch = ConnectionWatch()
        left = generate(r, client=watch)
        await until(lambda: len(sent(r, wire.GENERATE)) == 2)
        closed.close()
        watch.connection_lost()
        with pytest.raises(ClientDisconnected):
            await next_events(left)
        left.close()
        gone = ConnectionWatch()
        gone.connection_lost()
        never_sent = generate(r, client=gone)  # gone before it was sent: the engine hears nothing
        with pytest.raises(ClientDisconnected):
            await next_events(never_sent)
        never_sent.close()
        await r.everything_sent()
        numbers = [number for number, *_ in sent(r, wire.GENERATE)]
        assert len(numbers) == 2
        assert sorted(number for (number,) in sent(r, wire.CANCEL)) == numbers
        assert not r.runtime._generations


async def test_the_first_event_is_due_by_the_deadline_and_no_later_one(monkeypatch):
    monkeypatch.setattr(remote_parts, "DEADLINE_GRACE_S", 0.0)
    async with remote() as r:
        late = generate(r, timeout_s=0.05)
        with pytest.raises(ApiError) as timed_out:
            await next_events(late)
        assert (timed_out.value.status, timed_out.value.error_type) == (504, "deadline_exceeded")
        late.close()
        await r.everything_sent()
        [(number, *_)] = sent(r, wire.GENERATE)
        assert sent(r, wire.CANCEL) == [(number,)]

        started = generate(r, timeout_s=0.2)
        await until(lambda: len(sent(r, wire.GENERATE)) == 2)
        number = sent(r, wire.GENERATE)[1][0]
        r.engine.link.send(wire.TOKENS, (number,), wire.dumps([TokenEvent(0, "a")]))
        assert await next_events(started) == [TokenEvent(0, "a")]
        await asyncio.sleep(0.4)  # past its deadline: a generation may run for minutes
        r.engine.link.send(wire.END, (number,))
        with pytest.raises(EOFError):
            await next_events(started)
        started.close()


async def test_a_lost_engine_ends_every_generation_with_503_at_once():
    async with remote() as r:
        runs = [generate(r), generate(r)]
        await until(lambda: len(sent(r, wire.GENERATE)) == 2)
        r.engine.link.close()
        for run in runs:
            with pytest.raises(ApiError) as lost:
                await next_events(run)
            assert (lost.value.status, lost.value.error_type) == (503, "engine_unavailable")
            run.close()
        with pytest.raises(ApiError) as refused:
            generate(r)
        assert refused.value.error_type == "engine_unavailable"
