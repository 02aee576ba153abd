"""The request path's structure, which its cost per request rests on (never its timing):
one hand-off each way per batch, no task per request beyond the server's own, hot routes
that never enter FastAPI's stack, and a disconnect noticed without a watcher task."""

import asyncio
import contextlib
import math
import subprocess
import sys
import threading
from collections import Counter

import httpx
import pytest

import server.settings
from server import Settings, create_app
from server.lean import LeanFront
from server.middleware import RequestIds
from server.runtime.tokenize import idle_inline_limit, inline_limit, measure_inline_limit
from tests.fakes import ScriptedModel
from tests.inprocess import serve_in_thread
from tests.test_app import running
from tests.test_protocol_routes import VectorModel, v2_body

TIMEOUT = 10  # guards against hangs only


@contextlib.contextmanager
def counting_threadsafe_calls(loop):
    """Counts ``loop.call_soon_threadsafe`` calls (the way back from another thread)."""
    counts = Counter()
    original = loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):
        counts["threadsafe"] += 1
        return original(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted
    try:
        yield counts
    finally:
        del loop.call_soon_threadsafe


async def wait_until(predicate):
    async with asyncio.timeout(TIMEOUT):
        while not predicate():
            await asyncio.sleep(0.001)


async def test_one_hand_off_each_way_per_batch_whatever_its_size(registry, monkeypatch):
    monkeypatch.setattr(server.settings, "MEMORY_READING_INTERVAL_S", 0.0)  # one after each
    monkeypatch.setattr(server.settings, "MEMORY_READING_SHARE", None)  # however long it takes
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    settings = {"max_wait_ms": 0, "memory_release_idle_s": 0}
    async with running(model, registry, **settings) as client:
        app_runtime = client._transport.app.state.runtime
        gate.clear()
        model.entered.clear()
        calls_before, batches_before = app_runtime.model_thread.num_calls, len(model.batch_sizes)
        with counting_threadsafe_calls(asyncio.get_running_loop()) as counts:
            first = asyncio.create_task(client.post("/v1/infer", json={"inputs": "first"}))
            await wait_until(model.entered.is_set)  # no thread of the test's own here
            rest = [
                asyncio.create_task(client.post("/v1/infer", json={"inputs": f"next {i}"}))
                for i in range(7)
            ]
            await wait_until(lambda: len(app_runtime.queue) == 7)
            gate.set()
            answers = await asyncio.gather(first, *rest)
            await wait_until(lambda: not app_runtime.model_thread.busy)  # the last measurement
        calls = app_runtime.model_thread.num_calls - calls_before
    assert [a.status_code for a in answers] == [200] * 8
    assert model.batch_sizes[batches_before:] == [1, 7]
    # Two batches: two calls to the model thread, and none per request back. The first batch
    # ended with work waiting: its memory measurement came back with its outputs, in one
    # call_soon_threadsafe. The second ended with none, and a reading due: its outputs went
    # back first, the measurement after them.
    assert calls == 2
    assert counts["threadsafe"] == 3


def created_tasks(live):
    """Start recording the coroutine of every task the server's loop creates."""
    loop = live.server._loop
    names: list[str] = []
    installed = threading.Event()

    def factory(loop, coro, **kwargs):
        names.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kwargs)

    def install():
        loop.set_task_factory(factory)
        installed.set()

    loop.call_soon_threadsafe(install)
    assert installed.wait(TIMEOUT)
    return names


def test_a_request_runs_in_the_servers_own_task_alone():
    # Real uvicorn with our protocol: the connection tells the request of a disconnect.
    with serve_in_thread(ScriptedModel(), memory_release_idle_s=0) as live:
        names = created_tasks(live)
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as client:
            for i in range(20):
                response = client.post("/v1/infer", json={"inputs": [f"text {i}", "two"]})
                assert response.status_code == 200
        live.server._loop.call_soon_threadsafe(live.server._loop.set_task_factory, None)
    # uvicorn's task per request runs the whole request: no task waits for the work, none
    # watches for a disconnect.
    assert Counter(names) == {"RequestResponseCycle.run_asgi": 20}


async def test_the_hot_routes_never_enter_the_framework_stack(registry):
    async with running(VectorModel(), registry) as client:
        front = client._transport.app.middleware_stack
        assert isinstance(front, LeanFront)
        entered = Counter()
        fallback = front.fallback

        async def counted(scope, receive, send):
            entered[(scope["method"], scope["path"])] += 1
            await fallback(scope, receive, send)

        front.fallback = counted
        hot = [
            await client.post("/v1/infer", json={"inputs": "a"}),
            await client.post("/v1/embeddings", json={"input": "a", "model": "scripted"}),
            await client.post("/v2/models/scripted/infer", json=v2_body(["a"])),
            await client.post("/v2/models/scripted/versions/1/infer", json=v2_body(["a"])),
            await client.post("/v1/rerank", json={"query": "q", "documents": ["d"]}),
            await client.post("/v1/infer", json={"inputs": []}),  # refused by the handler
        ]
        other = [await client.get("/v1/models"), await client.get("/v1/infer")]
    assert [r.status_code for r in hot] == [200, 200, 200, 200, 400, 400]
    assert hot[4].json()["error_type"] == "wrong_task"  # an embedder is no reranker
    assert all(r.headers["x-request-id"] for r in hot)
    assert [r.status_code for r in other] == [200, 405]
    assert entered == {("GET", "/v1/models"): 1, ("GET", "/v1/infer"): 1}


async def test_a_hot_route_that_the_framework_routes_runs_the_same_handler(registry):
    async with running(VectorModel(), registry) as client:
        app = client._transport.app
        front = app.middleware_stack

        async def framework(scope, receive, send):
            """The framework's own stack, as an app built without the front serves it."""
            scope["app"] = app
            await front.fallback(scope, receive, send)

        transport = httpx.ASGITransport(app=framework)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as direct:
            answer = await direct.post("/v1/infer", json={"inputs": ["a b", "c"]})
            refused = await direct.post("/v1/infer", json={"inputs": "a", "priority": 99})
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"] == [[2.0, 3.0, 1.0], [1.0, 1.0, 1.0]]
    assert answer.json()["request_id"] == answer.headers["x-request-id"]
    assert refused.status_code == 422
    assert refused.json()["error"] == "priority: Input should be less than or equal to 10"


async def test_without_the_connections_hook_a_task_on_receive_notices_the_disconnect(registry):
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    async with running(model, registry, max_wait_ms=0) as client:
        app = client._transport.app
        app_runtime = app.state.runtime
        gate.clear()
        model.entered.clear()
        blocker = asyncio.create_task(client.post("/v1/infer", json={"inputs": "first"}))
        assert await asyncio.to_thread(model.entered.wait, TIMEOUT)
        gone = asyncio.Event()
        body = b'{"inputs": ["abandoned one", "abandoned two"]}'
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/infer", "raw_path": b"/v1/infer",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "headers": [(b"content-type", b"application/json")], "server": ("test", 80),
        }  # fmt: skip
        abandoned = asyncio.create_task(app(scope, receive, send))
        await wait_until(lambda: len(app_runtime.queue) == 2)
        gone.set()
        await asyncio.wait_for(abandoned, TIMEOUT)
        assert len(app_runtime.queue) == 0
        gate.set()
        assert (await blocker).status_code == 200
    assert sent[0]["status"] == 499
    assert not any(text.startswith("abandoned") for text in model.seen)
    assert registry.get_sample_value("batchfit_cancelled_items_total", {"stage": "queued"}) == 2


def test_request_ids_are_unique_and_each_process_draws_its_own_prefix(monkeypatch):
    ids = RequestIds()
    first = [ids.next() for _ in range(1000)]
    assert len(set(first)) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in first)
    assert len({i[:16] for i in first}) == 1
    monkeypatch.setattr("os.getpid", lambda: -42)  # as in a forked child
    assert ids.next()[:16] != first[0][:16]


async def test_on_ready_runs_once_just_before_the_replica_turns_ready(registry):
    seen = []
    app = create_app(
        Settings(sizer="fixed"), model=ScriptedModel(), registry=registry,
        on_ready=lambda: seen.append(app.state.runtime.ready),
    )  # fmt: skip
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        await wait_until(lambda: app.state.runtime.ready)
        assert (await client.post("/v1/infer", json={"inputs": "a"})).status_code == 200
    assert seen == [False]


def test_a_serving_process_freezes_its_start_up_heap():
    # Process-wide: in a process of its own.
    code = (
        "import gc; from server.heap import YOUNG_THRESHOLD, freeze_startup_heap; "
        "freeze_startup_heap(); "
        "assert gc.get_freeze_count() > 1000, gc.get_freeze_count(); "
        "assert gc.get_threshold()[0] == YOUNG_THRESHOLD"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # That a served replica does it is checked on a real one: tests/integration/test_server.py.


@pytest.mark.parametrize(
    ("costs_us", "handoff_us", "limit"),
    [
        ({16: 5, 64: 15, 256: 50, 1024: 200, 4096: 800}, 10, 64),  # 50 > 2 x 10
        ({16: 30, 64: 60, 256: 120}, 10, 0),  # a real tokenizer: even 16 chars
        ({16: 1, 64: 1, 256: 2, 1024: 3, 4096: 5}, 10, math.inf),  # nearly free: always inline
        ({16: 5, 64: 25, 256: 10}, 10, 16),  # a size over budget ends it, even if larger fit
    ],
)
def test_the_inline_limit_is_the_largest_size_within_two_hand_offs(costs_us, handoff_us, limit):
    costs = {chars: us * 1e-6 for chars, us in costs_us.items()}
    assert inline_limit(costs, handoff_us * 1e-6) == limit


@pytest.mark.parametrize(
    ("costs_us", "busy", "limit"),
    [
        ({16: 30, 64: 60, 256: 120, 1024: 480, 4096: 1900}, 0, 1024),  # within 1 ms
        ({16: 30, 64: 60, 256: 120, 1024: 480, 4096: 900}, 0, 4096),  # no more than measured
        ({16: 1, 64: 1, 256: 2}, math.inf, math.inf),  # nearly free: inline at any size
        ({16: 2000, 64: 4000}, 16, 16),  # never below the busy limit
    ],
)
def test_a_request_alone_is_tokenized_inline_within_the_idle_budget(costs_us, busy, limit):
    costs = {chars: us * 1e-6 for chars, us in costs_us.items()}
    assert idle_inline_limit(costs, busy) == limit


async def test_the_limit_is_measured_in_the_loops_cpu_time_of_each_side():
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731 - advanced by what "runs"

    def prepare(texts):
        now[0] += len(texts[0]) * 1e-6  # a microsecond a character

    async def handoff():
        now[0] += 40e-6

    limit, costs, handoff_s = await measure_inline_limit(prepare, handoff, clock=clock)
    assert handoff_s == pytest.approx(40e-6)
    assert costs[256] == pytest.approx(256e-6)
    assert limit == 64  # 256 us > 2 x 40 us


async def test_text_over_the_models_limit_is_tokenized_on_the_tokenizer_thread(registry):
    threads = []

    class Recording(ScriptedModel):
        def prepare(self, inputs, *, truncate):
            threads.append(threading.current_thread().name)
            return super().prepare(inputs, truncate=truncate)

    gate = threading.Event()
    gate.set()
    model = Recording(gate=gate)
    async with running(model, registry, max_wait_ms=0) as client:
        slot = client._transport.app.state.runtime.slot()
        slot.inline_tokenize_chars, slot.idle_inline_chars = 10, 40
        threads.clear()
        # Alone: inline up to the idle limit, then on the tokenizer thread.
        assert (await client.post("/v1/infer", json={"inputs": "short"})).status_code == 200
        within = await client.post("/v1/infer", json={"inputs": ["twelve chars", "and more"]})
        assert within.status_code == 200
        assert (await client.post("/v1/infer", json={"inputs": "x" * 41})).status_code == 200
        # With another request in progress: only up to the busy limit.
        gate.clear()
        model.entered.clear()
        first = asyncio.create_task(client.post("/v1/infer", json={"inputs": "brief"}))
        await wait_until(model.entered.is_set)
        second = asyncio.create_task(client.post("/v1/infer", json={"inputs": "twelve words"}))
        await wait_until(lambda: len(threads) == 5)
        gate.set()
        assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]
    assert threads == ["MainThread", "MainThread", "batchfit-tokenize_0", "MainThread",
                       "batchfit-tokenize_0"]  # fmt: skip


async def test_the_front_matches_hot_paths_under_a_root_path_and_only_posts(registry):
    async with running(VectorModel(), registry) as client:
        front = client._transport.app.middleware_stack

        def scope(path, root="", method="POST"):
            return {"type": "http", "method": method, "path": path, "root_path": root}

        assert front.match(scope("/api/v1/infer", "/api")).path == "/v1/infer"
        versioned = scope("/v2/models/a/b/versions/1/infer")
        assert front.match(versioned).path.endswith("/versions/{version}/infer")
        assert versioned["path_params"] == {"name": "a/b", "version": "1"}
        plain = scope("/v2/models/a/b/infer")
        assert front.match(plain).path == "/v2/models/{name:path}/infer"
        assert plain["path_params"] == {"name": "a/b"}
        assert front.match(scope("/v1/models")) is None
        assert front.match(scope("/v2/models/a/ready")) is None
