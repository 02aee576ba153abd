"""The streamed-load client against a scripted SSE server on a loopback port: chunk times,
the server's own token count, errors, cut streams and a prompt joining a running stream."""

import asyncio

import orjson
import pytest
from aiohttp import web

from bench.generate.client import closed_loop_streams, join_run, served_model


def _chunk(text, finish=None):
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return b"data: " + orjson.dumps({"object": "text_completion", "choices": [choice]}) + b"\n\n"


async def _completions(request):
    """Streams ``max_tokens`` chunks ``gap_s`` apart (both from the body), then the usage
    chunk (which claims ``usage_tokens`` where given) and [DONE]; a prompt of 'fail' is a 503."""
    body = await request.json()
    if body["prompt"] == "fail":
        return web.json_response({"error": {"message": "busy"}}, status=503)
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for i in range(body["max_tokens"]):
        await asyncio.sleep(body.get("gap_s", 0.01))
        await response.write(_chunk(f" t{i}"))
    await response.write(_chunk("", "length"))
    usage = {"completion_tokens": body.get("usage_tokens", body["max_tokens"]),
             "prompt_tokens": 3}  # fmt: skip
    await response.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


async def _models(request):
    return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})


@pytest.fixture
async def url():
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _body(**fields):
    return orjson.dumps({"prompt": "x", "stream": True, **fields})


async def test_each_stream_has_its_chunk_times_and_the_servers_token_count(url):
    bodies = [_body(max_tokens=5, gap_s=0.02), _body(max_tokens=3, usage_tokens=6),
              _body(prompt="fail", max_tokens=1)]  # fmt: skip
    run = await closed_loop_streams(url, bodies, concurrency=2, max_duration_s=10, timeout_s=10)
    first, second, failed = run.outcomes
    assert first.ok and len(first.token_times_s) == 5
    assert first.ttft_s >= 0.02
    assert all(gap >= 0.015 for gap in first.gaps_s())
    assert second.completion_tokens == 6  # the usage chunk's count wins over the chunks
    assert (failed.status, failed.ok) == (503, False)
    assert "busy" in failed.error
    assert run.wall_s >= first.end_s


async def test_streams_still_open_after_the_drain_are_cut_with_their_tokens(url):
    bodies = [_body(max_tokens=200, gap_s=0.01), _body(max_tokens=200, gap_s=0.01)]
    run = await closed_loop_streams(url, bodies, concurrency=1, max_duration_s=0.05,
                                    drain_s=0.3, timeout_s=10)  # fmt: skip
    assert len(run.outcomes) == 1  # the second was never sent: the level's time was up
    (cut,) = run.outcomes
    assert cut.cut and not cut.ok and cut.error is None
    assert 5 < cut.completion_tokens < 200
    assert cut.completion_tokens == len(cut.token_times_s)
    assert run.wall_s < 1.0


async def test_a_request_past_its_own_timeout_is_an_error_not_a_cut(url):
    run = await closed_loop_streams(url, [_body(max_tokens=100, gap_s=0.01)], concurrency=1,
                                    max_duration_s=10, timeout_s=0.2)  # fmt: skip
    (late,) = run.outcomes
    assert not late.cut
    assert late.error == "timed out after 0.2 s"


async def test_the_long_prompt_is_sent_once_the_running_stream_has_its_tokens(url):
    trial = await join_run(url, _body(max_tokens=30, gap_s=0.01), _body(max_tokens=4),
                           join_after=10, timeout_s=10)  # fmt: skip
    assert trial.first.ok and trial.joined.ok
    assert trial.first.token_times_s[9] <= trial.join_sent_s < trial.first.token_times_s[11]
    assert trial.joined.completion_tokens == 4


async def test_the_served_model_is_the_first_listed_and_none_where_there_is_no_list(url):
    assert await served_model(url) == "tiny"
    assert await served_model(url + "/nothing") is None
