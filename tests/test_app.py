"""The HTTP layer over a scripted model, in process (the integration tests use the real one)."""

import asyncio
import contextlib
import threading

import httpx
import pytest

from server import Settings, create_app
from tests.fakes import ScriptedModel

TIMEOUT = 10


@contextlib.asynccontextmanager
async def running(model, registry, wait_ready=True, probe=None, **settings):
    # A scripted model has no real memory to size batches by: a fixed budget, unless asked.
    settings = {"sizer": "fixed", **settings}
    app = create_app(Settings(**settings), model=model, registry=registry, probe=probe)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        if wait_ready:
            async with asyncio.timeout(TIMEOUT):
                while (await client.get("/health/ready")).status_code != 200:
                    await asyncio.sleep(0.01)
        yield client


def assert_error(response, status, error_type):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type", "request_id"}
    assert body["error_type"] == error_type
    assert body["request_id"] == response.headers["x-request-id"]
    return body


async def test_infer_returns_one_output_per_input_in_order(registry):
    async with running(ScriptedModel(), registry) as client:
        response = await client.post("/v1/infer", json={"inputs": ["a", "b c", "d"]})
    assert response.status_code == 200
    body = response.json()
    assert body["outputs"] == ["out:a", "out:b c", "out:d"]
    assert body["usage"] == {"input_tokens": 3 + 4 + 3}
    assert body["model"] == "scripted"


async def test_request_id_is_honoured_or_generated(registry):
    async with running(ScriptedModel(), registry) as client:
        given = await client.post(
            "/v1/infer", json={"inputs": "a"}, headers={"X-Request-ID": "abc-1"}
        )
        generated = await client.post("/v1/infer", json={"inputs": "a"})
        junk = await client.post("/v1/infer", json={"inputs": "a"}, headers={"X-Request-ID": "<x>"})
    assert given.headers["x-request-id"] == "abc-1" == given.json()["request_id"]
    assert len(generated.headers["x-request-id"]) == 32
    assert junk.headers["x-request-id"] != "<x>"


async def test_not_ready_until_warm_up_finishes(registry):
    gate = threading.Event()
    model = ScriptedModel(gate=gate)
    async with running(model, registry, wait_ready=False) as client:
        assert (await client.get("/health/live")).status_code == 200
        assert_error(await client.get("/health/ready"), 503, "not_ready")
        response = await client.post("/v1/infer", json={"inputs": "a"})
        assert_error(response, 503, "not_ready")
        assert response.headers["retry-after"] == "1"
        gate.set()
        async with asyncio.timeout(TIMEOUT):
            while (await client.get("/health/ready")).status_code != 200:
                await asyncio.sleep(0.01)
        assert (await client.post("/v1/infer", json={"inputs": "a"})).status_code == 200
    assert registry.get_sample_value("batchfit_rejections_total", {"reason": "not_ready"}) == 1


async def test_queue_full_is_429_with_retry_after_and_never_reaches_the_model(registry):
    gate = threading.Event()
    gate.set()  # warm-up runs freely
    model = ScriptedModel(gate=gate)
    async with running(model, registry, max_queue_items=2, max_inputs_per_request=2) as client:
        gate.clear()
        model.entered.clear()
        first = asyncio.ensure_future(client.post("/v1/infer", json={"inputs": "running"}))
        await asyncio.to_thread(model.entered.wait, TIMEOUT)  # its batch is on the model
        held = asyncio.ensure_future(client.post("/v1/infer", json={"inputs": ["a", "b"]}))
        async with asyncio.timeout(TIMEOUT):  # a guard against hangs
            while registry.get_sample_value("batchfit_queue_depth") != 2:
                await asyncio.sleep(0.01)
        response = await client.post("/v1/infer", json={"inputs": "c"})
        body = assert_error(response, 429, "overloaded")
        assert "queue is full (2 of 2 items waiting)" in body["error"]
        assert int(response.headers["retry-after"]) >= 1
        gate.set()
        assert [r.status_code for r in await asyncio.gather(first, held)] == [200, 200]
    assert "c" not in model.seen


async def test_a_request_the_queue_can_never_hold_is_413_not_429(registry):
    """Two models given in code (the settings name one, so start-up cannot check the share):
    a's share is 2 of the queue's 4 items; 3 inputs for a would get 429 for ever."""
    from tests.test_multimodel_app import classifier

    a = ScriptedModel()
    app = create_app(
        Settings(sizer="fixed", max_queue_items=4, max_queue_share=0.5, max_inputs_per_request=4),
        models={"a": a, "b": classifier()}, registry=registry,
    )  # fmt: skip
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        async with asyncio.timeout(TIMEOUT):
            while (await client.get("/health/ready")).status_code != 200:
                await asyncio.sleep(0.01)
        never = await client.post("/v1/infer", json={"inputs": ["1", "2", "3"], "model": "a"})
        fits = await client.post("/v1/infer", json={"inputs": ["1", "2"], "model": "a"})
    body = assert_error(never, 413, "too_many_inputs")
    assert body["error"] == (
        "3 inputs can never be admitted: model 'a' may hold at most 2 of the queue's items; "
        "send fewer per request"
    )
    assert "retry-after" not in never.headers
    assert fits.status_code == 200
    assert registry.get_sample_value("batchfit_rejections_total", {"reason": "too_large"}) == 1


async def test_deadline_passed_while_waiting_is_504(registry):
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    async with running(model, registry) as client:
        gate.clear()
        model.entered.clear()
        blocker = asyncio.create_task(client.post("/v1/infer", json={"inputs": "first"}))
        assert await asyncio.to_thread(model.entered.wait, TIMEOUT)
        late = await client.post("/v1/infer", json={"inputs": "late", "timeout_s": 0.05})
        assert_error(late, 504, "deadline_exceeded")
        gate.set()
        assert (await blocker).status_code == 200
    assert "late" not in model.seen


async def test_one_input_that_never_fits_gets_507_and_others_succeed(registry):
    model = ScriptedModel(oom_above_tokens=40)
    huge = " ".join(["w"] * 50)
    async with running(model, registry, max_batch_tokens=40, max_batch_size=4) as client:
        bad, good = await asyncio.gather(
            client.post("/v1/infer", json={"inputs": ["ok", huge]}),
            client.post("/v1/infer", json={"inputs": ["fine", "also fine"]}),
        )
    body = assert_error(bad, 507, "out_of_memory")
    assert "input 1 (52 tokens)" in body["error"]
    assert good.json()["outputs"] == ["out:fine", "out:also fine"]


async def test_model_failure_is_500_without_internals(registry):
    model = ScriptedModel()
    async with running(model, registry) as client:
        model.fail_with = RuntimeError("secret stack detail")
        body = assert_error(
            await client.post("/v1/infer", json={"inputs": "a"}), 500, "internal_error"
        )
        assert "secret" not in body["error"]
        model.fail_with = None
        assert (await client.post("/v1/infer", json={"inputs": "a"})).status_code == 200


@pytest.mark.parametrize(
    ("kwargs", "status", "error_type"),
    [
        (
            {"content": b"{not json", "headers": {"content-type": "application/json"}},
            400,
            "invalid_json",
        ),
        ({"json": {"inputs": []}}, 400, "empty_input"),
        ({"json": {"inputs": ["a", ""]}}, 400, "empty_input"),
        ({"json": {"inputs": [1, 2]}}, 422, "invalid_request"),
        ({"json": {"inputs": [["a"]]}}, 422, "invalid_request"),
        ({"json": {"inputs": None}}, 422, "invalid_request"),
        ({"json": {}}, 422, "invalid_request"),
        ({"json": {"inputs": "a", "unknown": 1}}, 422, "invalid_request"),
        ({"json": {"inputs": "a", "timeout_s": -1}}, 422, "invalid_request"),
        (
            {
                "content": b'{"inputs": "a", "timeout_s": NaN}',
                "headers": {"content-type": "application/json"},
            },
            422,
            "invalid_request",
        ),
        ({"json": {"inputs": ["a"] * 5}}, 413, "too_many_inputs"),
        (
            {"content": b"x" * 5000, "headers": {"content-type": "application/json"}},
            413,
            "payload_too_large",
        ),
        (
            {"content": b'{"inputs": "a"}', "headers": {"content-type": "text/plain"}},
            415,
            "unsupported_media_type",
        ),
    ],
)
async def test_bad_input(registry, kwargs, status, error_type):
    model = ScriptedModel()
    async with running(model, registry, max_inputs_per_request=4, max_body_bytes=4096) as client:
        warm_batches = len(model.batch_sizes)
        assert_error(await client.post("/v1/infer", **kwargs), status, error_type)
        assert len(model.batch_sizes) == warm_batches
        assert (await client.post("/v1/infer", json={"inputs": "still serving"})).status_code == 200


async def test_metrics_and_models(registry):
    async with running(ScriptedModel(), registry) as client:
        await client.post("/v1/infer", json={"inputs": ["a", "b"]})
        scrape = (await client.get("/metrics")).text
        models = (await client.get("/v1/models")).json()
    assert 'batchfit_requests_total{code="200",endpoint="/v1/infer",error_type=""} 1.0' in scrape
    assert "batchfit_batch_size_bucket" in scrape
    assert "batchfit_queue_depth 0.0" in scrape
    assert models["models"][0]["name"] == "scripted"


@pytest.mark.parametrize(
    ("kwargs", "status", "message"),
    [
        ({"content": b'{"inputs": "\xff\xfe"}'}, 400, "body is not valid UTF-8"),
        ({"json": {"inputs": [1, 2]}}, 422, "inputs must be a string or a list of strings"),
        ({"json": {"inputs": 5}}, 422, "inputs must be a string or a list of strings"),
        ({"json": {"inputs": [["a"]]}}, 422, "inputs must be a string or a list of strings"),
        (
            {"json": {"inputs": 5, "truncate": "yes"}},
            422,
            "inputs must be a string or a list of strings; truncate: Input should be true, "
            "false, 'end', 'start', 'none' or 'chunk'",
        ),
        ({"json": {}}, 422, "inputs: Field required"),
    ],
)
async def test_error_messages_say_what_is_wrong(registry, kwargs, status, message):
    headers = {"content-type": "application/json"}
    async with running(ScriptedModel(), registry) as client:
        response = await client.post("/v1/infer", headers=headers, **kwargs)
    body = assert_error(response, status, "invalid_json" if status == 400 else "invalid_request")
    assert body["error"] == message


async def test_truncation_direction_is_checked_and_needs_a_model_that_takes_it(registry):
    async with running(ScriptedModel(), registry) as client:
        bad = await client.post("/v1/infer", json={"inputs": "a", "truncation_direction": "middle"})
        unsupported = await client.post(
            "/v1/infer", json={"inputs": "a", "truncation_direction": "left"}
        )
        kserve = await client.post(
            "/v2/models/scripted/infer",
            json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}],
                  "parameters": {"truncation_direction": "up"}},
        )  # fmt: skip
        after = await client.post("/v1/infer", json={"inputs": "a"})
    assert_error(bad, 422, "invalid_request")
    body = assert_error(unsupported, 400, "unsupported_parameter")
    assert "truncation_direction" in body["error"]
    assert kserve.status_code == 400, kserve.text  # KServe's own error shape
    assert "truncation_direction must be right or left" in kserve.json()["error"]
    assert after.status_code == 200
