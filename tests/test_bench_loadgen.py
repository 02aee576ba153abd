"""The load generator against a small loopback HTTP server that records what it receives."""

import asyncio
import socket
import time

import orjson
import pytest
from aiohttp import web

from bench.loadgen import CLIENTS, closed_loop, encode_bodies, in_turn, open_loop


async def start_site(infer) -> tuple[web.AppRunner, str]:
    """A loopback server answering ``POST /v1/infer`` with ``infer``; its runner and url."""
    app = web.Application()
    app.router.add_post("/v1/infer", infer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def echo_server():
    seen: list[list[str]] = []

    async def infer(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        seen.append(body["inputs"])
        status = 429 if body["inputs"] == ["reject"] else 200
        return web.json_response({"outputs": len(body["inputs"])}, status=status)

    runner, url = await start_site(infer)
    yield url, seen
    await runner.cleanup()


@pytest.mark.parametrize("client", CLIENTS)
async def test_closed_loop_sends_each_request_once_and_runs_the_hook_between(echo_server, client):
    url, seen = echo_server
    requests = [["a"], ["b", "c"], ["reject"], ["d"]]
    calls: list[tuple[int, int]] = []
    run = await closed_loop(url, requests, concurrency=1, max_duration_s=30, client=client,
                            after_each=lambda i: calls.append((i, len(seen))))  # fmt: skip
    assert seen == requests
    # The hook ran after request i was answered and before request i + 1 was sent.
    assert calls == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [o.status for o in run.outcomes] == [200, 200, 429, 200]
    assert [o.num_inputs for o in run.outcomes] == [1, 2, 1, 1]


async def test_a_refused_connection_is_status_zero_with_either_client():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once closed
    for client in CLIENTS:
        run = await closed_loop(f"http://127.0.0.1:{port}", [["a"]], concurrency=1,
                                max_duration_s=10, timeout_s=5, client=client)  # fmt: skip
        assert [o.status for o in run.outcomes] == [0]
    with pytest.raises(ValueError, match="unknown client"):
        await closed_loop(f"http://127.0.0.1:{port}", [["a"]], concurrency=1,
                          max_duration_s=1, client="curl")  # fmt: skip


async def test_the_hook_needs_one_client(echo_server):
    url, _ = echo_server
    with pytest.raises(ValueError, match="concurrency 1"):
        await closed_loop(url, [["a"]], concurrency=2, max_duration_s=5, after_each=print)


async def test_open_loop_sends_at_the_given_times_without_waiting_for_answers():
    """A loopback server records when each request arrives. The first request is answered only
    once the last one has arrived, so a client that waited for answers would stall."""
    send_times = [0.0, 0.15, 0.3, 0.45]
    arrivals: dict[str, float] = {}
    last_arrived = asyncio.Event()

    async def infer(request: web.Request) -> web.Response:
        (text,) = orjson.loads(await request.read())["inputs"]
        arrivals[text] = time.perf_counter()
        if text == "3":
            last_arrived.set()
        if text == "0":
            await asyncio.wait_for(last_arrived.wait(), 10)
        return web.json_response({"outputs": [text]})

    runner, url = await start_site(infer)
    try:
        requests = [[str(i)] for i in range(len(send_times))]
        run = await open_loop(url, requests, send_times, timeout_s=20)
    finally:
        await runner.cleanup()
    assert [o.status for o in run.outcomes] == [200] * len(send_times)
    assert [o.sent_s for o in run.outcomes] == pytest.approx(send_times)
    # Each request arrived at its send time after the first (never early, and not late by
    # more than a loaded host's scheduling delay); the first was answered after the last.
    offsets = [arrivals[str(i)] - arrivals["0"] for i in range(len(send_times))]
    for offset, at in zip(offsets, send_times, strict=True):
        assert at - 0.01 <= offset <= at + 0.1, (offsets, send_times)
    assert run.outcomes[0].latency_s >= send_times[-1] - 0.01


async def test_a_dead_server_reads_as_status_0():
    run = await open_loop("http://127.0.0.1:9", [["a"], ["b"]], [0.0, 0.01], timeout_s=5)
    assert [o.status for o in run.outcomes] == [0, 0]


@pytest.fixture
async def two_servers():
    """Two loopback servers writing into one log, in the order requests reach them."""
    log: list[tuple[str, list[str]]] = []
    runners, urls = [], []
    for name in ("first", "second"):

        async def infer(request: web.Request, name: str = name) -> web.Response:
            log.append((name, orjson.loads(await request.read())["inputs"]))
            return web.json_response({"outputs": 1})

        runner, url = await start_site(infer)
        runners.append(runner)
        urls.append(url)
    yield urls, log
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize("client", CLIENTS)
async def test_in_turn_sends_each_request_to_both_servers_one_at_a_time(two_servers, client):
    urls, log = two_servers
    requests = [["a"], ["b", "c"], ["d"]]
    first, second = await in_turn(urls, requests, max_duration_s=30, client=client)
    # Every request reaches both, the one that gets it first alternating.
    assert log == [("first", ["a"]), ("second", ["a"]), ("second", ["b", "c"]),
                   ("first", ["b", "c"]), ("first", ["d"]), ("second", ["d"])]  # fmt: skip
    for run in (first, second):
        assert [o.num_inputs for o in run.outcomes] == [1, 2, 1]
        assert all(o.status == 200 for o in run.outcomes)
        # Each server's wall time is the time its own requests took.
        assert run.wall_s == pytest.approx(sum(o.latency_s for o in run.outcomes))


def test_a_request_repeated_as_one_object_is_encoded_once_and_fresh_ones_each_anew():
    repeated = ["same"]
    bodies = encode_bodies([repeated] * 1000)
    assert bodies[0] == b'{"inputs":["same"]}' and all(b is bodies[0] for b in bodies)
    # Lists made one at a time and dropped could share an address: each is its own body.
    fresh = encode_bodies([f"text {i}"] for i in range(1000))
    assert fresh == [orjson.dumps({"inputs": [f"text {i}"]}) for i in range(1000)]
