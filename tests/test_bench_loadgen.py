"""The load generator against a small loopback HTTP server that records what it receives."""

import orjson
import pytest
from aiohttp import web

from bench.loadgen import closed_loop, open_loop


@pytest.fixture
async def echo_server():
    seen: list[list[str]] = []

    async def infer(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        seen.append(body["inputs"])
        status = 429 if body["inputs"] == ["reject"] else 200
        return web.json_response({"outputs": len(body["inputs"])}, status=status)

    app = web.Application()
    app.router.add_post("/v1/infer", infer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def test_closed_loop_sends_each_request_once_and_runs_the_hook_between(echo_server):
    url, seen = echo_server
    requests = [["a"], ["b", "c"], ["reject"], ["d"]]
    calls: list[tuple[int, int]] = []
    run = await closed_loop(url, requests, concurrency=1, max_duration_s=30,
                            after_each=lambda i: calls.append((i, len(seen))))  # fmt: skip
    assert seen == requests
    # The hook ran after request i was answered and before request i + 1 was sent.
    assert calls == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [o.status for o in run.outcomes] == [200, 200, 429, 200]
    assert [o.num_inputs for o in run.outcomes] == [1, 2, 1, 1]


async def test_the_hook_needs_one_client(echo_server):
    url, _ = echo_server
    with pytest.raises(ValueError, match="concurrency 1"):
        await closed_loop(url, [["a"]], concurrency=2, max_duration_s=5, after_each=print)


async def test_open_loop_sends_at_the_given_times_and_a_dead_server_reads_as_status_0():
    run = await open_loop("http://127.0.0.1:9", [["a"], ["b"]], [0.0, 0.05], timeout_s=5)
    assert [o.status for o in run.outcomes] == [0, 0]
    assert run.outcomes[1].sent_s == pytest.approx(0.05)
    assert run.wall_s >= 0.05
