"""Auth, priorities, bad input and the batcher-crash policy, over a scripted model in process."""

import asyncio
import base64
import logging
import threading

import httpx
import pytest

from batching import FixedSizer
from server import Settings, create_app
from server.auth import basic_key_matches, key_matches
from tests.fakes import ScriptedModel
from tests.test_app import TIMEOUT, assert_error, running

# --- auth ---


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (None, False),
        (b"Bearer right", True),
        (b"bearer right", True),
        (b"Bearer  right ", True),
        (b"Bearer wrong", False),
        (b"Bearer righ", False),
        (b"Bearer right2", False),
        (b"Basic right", False),
        (b"right", False),
        (b"Bearer other", True),
    ],
)
def test_key_matches(header, ok):
    assert key_matches(header, [b"right", b"other"]) is ok


def _basic(user: bytes, password: bytes) -> bytes:
    return b"Basic " + base64.b64encode(user + b":" + password)


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (None, False),
        (_basic(b"me", b"right"), True),
        (_basic(b"", b"other"), True),
        (_basic(b"right", b""), False),
        (_basic(b"me", b"righ"), False),
        (b"Basic !!!notbase64", False),
        (b"Basic " + base64.b64encode(b"right"), False),
        (b"Bearer right", False),
    ],
)
def test_basic_key_matches(header, ok):
    assert basic_key_matches(header, [b"right", b"other"]) is ok


async def test_api_key_guards_the_api_but_not_health_or_metrics(registry):
    model = ScriptedModel()
    async with running(model, registry, api_key="s3cret") as client:
        warm = len(model.batch_sizes)
        missing = await client.post("/v1/infer", json={"inputs": "a"})
        wrong = await client.post(
            "/v1/infer", json={"inputs": "a"}, headers={"Authorization": "Bearer nope"}
        )
        for response in (missing, wrong):
            assert_error(response, 401, "unauthorized")
            assert response.headers["www-authenticate"] == "Bearer"
            assert "s3cret" not in response.text
        assert_error(await client.get("/v1/models"), 401, "unauthorized")
        assert_error(await client.get("/openapi.json"), 401, "unauthorized")
        assert len(model.batch_sizes) == warm
        good = await client.post(
            "/v1/infer", json={"inputs": "a"}, headers={"Authorization": "Bearer s3cret"}
        )
        assert good.json()["outputs"] == ["out:a"]
        for path in ("/health/live", "/health/ready", "/metrics"):
            assert (await client.get(path)).status_code == 200
    assert registry.get_sample_value("batchfit_rejections_total", {"reason": "unauthorized"}) == 3


async def test_api_key_file_holds_several_keys(registry, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# rotated monthly\nold-key\n\nnew-key\n")
    async with running(ScriptedModel(), registry, api_key_file=keys) as client:
        for key in ("old-key", "new-key"):
            headers = {"Authorization": f"Bearer {key}"}
            assert (
                await client.post("/v1/infer", json={"inputs": "a"}, headers=headers)
            ).is_success
        bad = await client.post(
            "/v1/infer", json={"inputs": "a"}, headers={"Authorization": "Bearer # rotated monthly"}
        )
        assert_error(bad, 401, "unauthorized")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"api_key": " "}, "api_key is empty"),
        ({"api_key_file": "/nonexistent/keys"}, "cannot read api_key_file"),
    ],
)
def test_bad_key_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        Settings(**settings)


def test_empty_key_file_is_refused(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        Settings(api_key_file=empty)


# --- priorities ---


async def test_higher_priority_runs_first_fifo_within_a_priority(registry):
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    async with running(model, registry, max_batch_size=1, max_wait_ms=0) as client:
        gate.clear()
        model.entered.clear()
        blocker = asyncio.create_task(client.post("/v1/infer", json={"inputs": "blocker"}))
        assert await asyncio.to_thread(model.entered.wait, TIMEOUT)
        requests = [("low", -5), ("normal a", 0), ("high", 5), ("normal b", 0)]
        tasks = []
        for text, priority in requests:
            body = {"inputs": text, "priority": priority}
            tasks.append(asyncio.create_task(client.post("/v1/infer", json=body)))
            await asyncio.sleep(0)  # the request reaches the queue before the next one
        async with asyncio.timeout(TIMEOUT):
            while registry.get_sample_value("batchfit_queue_depth") != len(requests):
                await asyncio.sleep(0.005)
        model.seen.clear()
        gate.set()
        responses = await asyncio.gather(blocker, *tasks)
    assert all(r.status_code == 200 for r in responses)
    assert model.seen == ["blocker", "high", "normal a", "normal b", "low"]


# --- bad input ---


@pytest.mark.parametrize(
    ("kwargs", "status", "error_type"),
    [
        pytest.param(
            {"content": b'{"inputs": "caf\xe9"}', "headers": {"content-type": "application/json"}},
            400, "invalid_json", id="invalid-utf8",
        ),
        pytest.param(
            {"content": b'{"inputs": ["ok", "\\ud800"]}',
             "headers": {"content-type": "application/json"}},
            422, "invalid_request", id="lone-surrogate",
        ),
        pytest.param(
            {"content": b'{"inputs": "a", "timeout_s": 1e999}',
             "headers": {"content-type": "application/json"}},
            422, "invalid_request", id="timeout-infinite",
        ),
        pytest.param({"json": {"inputs": "a", "timeout_s": 0}}, 422, "invalid_request",
                     id="timeout-zero"),
        pytest.param({"json": {"inputs": "a", "timeout_s": "5"}}, 422, "invalid_request",
                     id="timeout-string"),
        pytest.param({"json": {"inputs": "a", "priority": 11}}, 422, "invalid_request",
                     id="priority-too-high"),
        pytest.param({"json": {"inputs": "a", "priority": 1.5}}, 422, "invalid_request",
                     id="priority-float"),
        pytest.param({"json": {"inputs": "a", "priority": "1"}}, 422, "invalid_request",
                     id="priority-string"),
        pytest.param({"json": {"inputs": "a", "truncate": "yes"}}, 422, "invalid_request",
                     id="truncate-string"),
        pytest.param({"json": {"inputs": "a"}, "headers": {"X-Timeout-S": "-1"}}, 422,
                     "invalid_request", id="header-timeout-negative"),
        pytest.param({"json": {"inputs": "a"}, "headers": {"X-Timeout-S": "nan"}}, 422,
                     "invalid_request", id="header-timeout-nan"),
        pytest.param({"json": {"inputs": "a"}, "headers": {"X-Timeout-S": "soon"}}, 422,
                     "invalid_request", id="header-timeout-text"),
        pytest.param({"json": ["a"]}, 422, "invalid_request", id="body-a-list"),
        pytest.param({"json": "a"}, 422, "invalid_request", id="body-a-string"),
        pytest.param({"json": {"inputs": ["a"] * 100_000}}, 413, "too_many_inputs",
                     id="huge-number-of-inputs"),
    ],
)  # fmt: skip
async def test_more_bad_input(registry, kwargs, status, error_type):
    model = ScriptedModel()
    async with running(model, registry, max_body_bytes=2**20) as client:
        warm = len(model.batch_sizes)
        body = assert_error(await client.post("/v1/infer", **kwargs), status, error_type)
        assert "Traceback" not in body["error"]
        assert len(model.batch_sizes) == warm
        assert (await client.post("/v1/infer", json={"inputs": "still serving"})).status_code == 200


@pytest.mark.parametrize(
    ("body", "headers", "deadline_s"),
    [
        pytest.param({}, {}, 2, id="default"),
        pytest.param({"timeout_s": 1e300}, {}, 5, id="body-capped"),
        pytest.param({}, {"X-Timeout-S": "1e300"}, 5, id="header-capped"),
        pytest.param({"timeout_s": 1e300}, {"X-Timeout-S": "1e308"}, 5, id="both-capped"),
        pytest.param({"timeout_s": 0.75}, {"X-Timeout-S": "3"}, 0.75, id="smaller-body-wins"),
        pytest.param({"timeout_s": 3}, {"X-Timeout-S": "0.75"}, 0.75, id="smaller-header-wins"),
    ],
)  # fmt: skip
async def test_effective_deadline_is_the_smaller_ask_capped(registry, body, headers, deadline_s):
    """The deadline a queued item carries: the smaller of body and header, capped at
    max_timeout_s, the default when neither asks."""
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    settings = Settings(sizer="fixed", default_timeout_s=2, max_timeout_s=5)
    app = create_app(settings, model=model, registry=registry)
    runtime = app.state.runtime
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client,
    ):
        async with asyncio.timeout(TIMEOUT):
            while not runtime.ready:
                await asyncio.sleep(0.01)
        gate.clear()
        model.entered.clear()
        blocker = asyncio.create_task(client.post("/v1/infer", json={"inputs": "blocker"}))
        assert await asyncio.to_thread(model.entered.wait, TIMEOUT)
        asked = asyncio.create_task(
            client.post("/v1/infer", json={"inputs": "a", **body}, headers=headers)
        )
        try:
            async with asyncio.timeout(TIMEOUT):
                while not runtime.queue.waiting():
                    await asyncio.sleep(0.005)
            (queued,) = runtime.queue.waiting()
            # The deadline counts from the request's arrival, the item's arrival_s from its
            # queueing: tokenizing lies between (microseconds here; the bound is a guard).
            assert queued.deadline_s - queued.arrival_s == pytest.approx(deadline_s, abs=0.1)
        finally:
            gate.set()
        assert (await blocker).status_code == 200
        assert (await asyncio.wait_for(asked, TIMEOUT)).json()["outputs"] == ["out:a"]


async def test_tiny_body_timeout_under_a_larger_header_is_504(registry):
    async with running(ScriptedModel(), registry) as client:
        response = await client.post(
            "/v1/infer", json={"inputs": "a", "timeout_s": 1e-300}, headers={"X-Timeout-S": "50"}
        )
    assert_error(response, 504, "deadline_exceeded")


async def test_header_deadline_passed_while_queued_is_504(registry):
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    async with running(model, registry) as client:
        gate.clear()
        model.entered.clear()
        blocker = asyncio.create_task(client.post("/v1/infer", json={"inputs": "first"}))
        assert await asyncio.to_thread(model.entered.wait, TIMEOUT)
        late = await client.post(
            "/v1/infer", json={"inputs": "late"}, headers={"X-Timeout-S": "0.05"}
        )
        assert_error(late, 504, "deadline_exceeded")
        gate.set()
        assert (await blocker).status_code == 200
    assert "late" not in model.seen


async def test_errors_never_echo_the_input(registry, caplog):
    secret = "my-secret-sentence"
    caplog.set_level(logging.DEBUG)
    async with running(ScriptedModel(), registry) as client:
        cases = [
            {"inputs": secret, "unknown": secret},
            {"inputs": [secret, 7]},
            {"inputs": secret, "timeout_s": secret},
        ]
        for body in cases:
            response = await client.post("/v1/infer", json=body)
            assert response.status_code == 422, response.text
            assert secret not in response.text
    assert all(secret not in r.getMessage() for r in caplog.records)


# --- batcher crash ---


class CrashingSizer(FixedSizer):
    """Raises from inside the batcher loop (not from a forward pass) once armed."""

    armed = False

    def budget(self, reading=None):
        if self.armed:
            raise RuntimeError("bug in the loop")
        return super().budget(reading)


async def test_batcher_crash_fails_requests_with_500_turns_not_ready_and_stops(registry, caplog):
    sizer = CrashingSizer(32, 4096)
    fatal = asyncio.Event()
    app = create_app(
        Settings(), model=ScriptedModel(), registry=registry, sizer=sizer, on_fatal=fatal.set
    )
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        async with asyncio.timeout(TIMEOUT):
            while (await client.get("/health/ready")).status_code != 200:
                await asyncio.sleep(0.01)
        sizer.armed = True
        body = assert_error(await client.post("/v1/infer", json={"inputs": "a"}), 500,
                            "internal_error")  # fmt: skip
        assert "bug" not in body["error"]
        await asyncio.wait_for(fatal.wait(), TIMEOUT)
        assert_error(await client.get("/health/ready"), 503, "not_ready")
        assert_error(await client.post("/v1/infer", json={"inputs": "b"}), 503, "not_ready")
    assert app.state.runtime.batcher_error is not None
    crash = [r for r in caplog.records if "batcher crashed" in r.getMessage()]
    assert crash and crash[0].exc_info is not None  # logged with its traceback
    assert registry.get_sample_value("batchfit_ready") == 0
