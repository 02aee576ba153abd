"""The profiler records on the model thread; the admin endpoints arm it behind a token."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch

from batching import ModelThread
from models import BatchProfiler, Item, ProfilerBusy
from server import Settings, create_app
from tests.fakes import ScriptedModel
from tests.test_app import assert_error, running

TOKEN = "admin-secret"


class TorchForward:
    """A real torch forward that records which thread ran it."""

    def __init__(self) -> None:
        self.layer = torch.nn.Linear(8, 4)
        self.threads: list[str] = []

    def __call__(self, items):
        self.threads.append(threading.current_thread().name)
        with torch.inference_mode():
            out = self.layer(torch.ones(len(items), 8))
        return list(out)


@pytest.fixture
def thread_log(monkeypatch):
    """Record the thread that starts and stops the torch profiler."""
    calls: list[tuple[str, str]] = []
    real = torch.profiler.profile  # the profiler imports it when a trace starts

    class RecordingProfile(real):
        def start(self):
            calls.append(("start", threading.current_thread().name))
            return super().start()

        def stop(self):
            calls.append(("stop", threading.current_thread().name))
            return super().stop()

    monkeypatch.setattr(torch.profiler, "profile", RecordingProfile)
    return calls


async def test_records_the_next_n_batches_on_the_model_thread(tmp_path, thread_log):
    forward = TorchForward()
    profiler = BatchProfiler(tmp_path / "traces")
    wrapped = profiler.wrap(forward)
    thread = ModelThread(name="batchfit-model")
    items = [Item(data=None, cost=3), Item(data=None, cost=5)]
    try:
        await thread.call(wrapped, items)  # not armed: nothing recorded
        assert profiler.status().state == "idle"
        assert thread_log == []
        path = profiler.arm(2)
        assert profiler.status().state == "armed"
        with pytest.raises(ProfilerBusy):
            profiler.arm(1)
        await thread.call(wrapped, items)
        assert profiler.status().state == "recording"
        assert profiler.status().batches_recorded == 1
        await thread.call(wrapped, items[:1])
        status = profiler.status()
        assert status.state == "idle"
        assert status.last_trace_path == str(path)
        await thread.call(wrapped, items)  # after N batches, no more recording
    finally:
        thread.close()
    assert len(forward.threads) == 4
    assert {name for name in forward.threads} == {t for _, t in thread_log}
    assert [kind for kind, _ in thread_log] == ["start", "stop"]
    assert all(name.startswith("batchfit-model") for _, name in thread_log)
    assert threading.main_thread().name not in {name for _, name in thread_log}
    trace = json.loads(path.read_text())
    names = [event.get("name", "") for event in trace["traceEvents"]]
    assert names.count("batchfit_batch[2x5]") == 1
    assert names.count("batchfit_batch[1x3]") == 1
    assert any(name == "aten::linear" for name in names)
    assert not list(path.parent.glob("*.partial"))


async def test_a_failed_batch_still_counts_and_the_error_propagates(tmp_path):
    profiler = BatchProfiler(tmp_path)

    def failing(items):
        raise RuntimeError("boom")

    wrapped = profiler.wrap(failing)
    profiler.arm(1)
    with pytest.raises(RuntimeError, match="boom"):
        wrapped([Item(data=None, cost=1)])
    assert profiler.status().state == "idle"
    assert profiler.status().last_trace_path is not None


def test_arm_refuses_zero_batches(tmp_path):
    with pytest.raises(ValueError, match="at least 1"):
        BatchProfiler(tmp_path).arm(0)


async def test_admin_endpoints_do_not_exist_without_a_token(registry):
    async with running(ScriptedModel(), registry) as client:
        assert_error(await client.post("/admin/profile", json={}), 404, "not_found")
        paths = (await client.get("/openapi.json")).json()["paths"]
    assert not any(path.startswith("/admin") for path in paths)


async def test_admin_profile_needs_the_token_and_records_batches(registry, tmp_path):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with running(
        ScriptedModel(), registry, admin_token=TOKEN, profile_dir=str(tmp_path)
    ) as client:
        assert_error(await client.post("/admin/profile", json={}), 401, "unauthorized")
        wrong = {"Authorization": "Bearer nope"}
        assert_error(await client.get("/admin/profile", headers=wrong), 401, "unauthorized")
        assert_error(
            await client.post("/admin/profile", json={"num_batches": 0}, headers=auth),
            422, "invalid_request",
        )  # fmt: skip
        armed = await client.post("/admin/profile", json={"num_batches": 2}, headers=auth)
        assert armed.status_code == 202
        assert armed.json()["state"] == "armed"
        busy = await client.post("/admin/profile", headers=auth)
        assert_error(busy, 409, "profile_busy")
        for text in ("one", "two"):
            assert (await client.post("/v1/infer", json={"inputs": text})).status_code == 200
        async with asyncio.timeout(10):
            while (status := (await client.get("/admin/profile", headers=auth)).json())[
                "state"
            ] != "idle":
                await asyncio.sleep(0.01)
        paths = (await client.get("/openapi.json")).json()["paths"]
    assert status["batches_recorded"] == 2
    assert status["last_trace_path"] == armed.json()["trace_path"]
    events = json.loads(Path(status["last_trace_path"]).read_text())["traceEvents"]
    assert sum(e.get("name", "").startswith("batchfit_batch[") for e in events) == 2
    assert set(paths["/admin/profile"]) == {"get", "post"}
    assert "security" in paths["/admin/profile"]["post"]


async def test_a_recording_cut_short_by_shutdown_is_written_with_its_batches(
    registry, tmp_path, thread_log
):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with running(
        ScriptedModel(), registry, admin_token=TOKEN, profile_dir=str(tmp_path)
    ) as client:
        armed = await client.post("/admin/profile", json={"num_batches": 5}, headers=auth)
        assert (await client.post("/v1/infer", json={"inputs": "one"})).status_code == 200
        status = (await client.get("/admin/profile", headers=auth)).json()
        assert (status["state"], status["batches_recorded"]) == ("recording", 1)
    # The server stopped with the profiler still recording: it stopped on the model thread
    # and wrote the one batch it had.
    assert [what for what, _ in thread_log] == ["start", "stop"]
    assert thread_log[0][1] == thread_log[1][1] != threading.main_thread().name
    events = json.loads(Path(armed.json()["trace_path"]).read_text())["traceEvents"]
    assert sum(e.get("name", "").startswith("batchfit_batch[") for e in events) == 1


async def test_an_unwritable_profile_dir_is_a_clear_error_and_nothing_else_breaks(
    registry, tmp_path
):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with running(
        ScriptedModel(), registry, admin_token=TOKEN, profile_dir=str(blocker / "traces")
    ) as client:
        armed = await client.post("/admin/profile", headers=auth)
        body = assert_error(armed, 500, "profile_dir_unwritable")
        assert str(blocker / "traces") in body["error"]
        assert (await client.get("/admin/profile", headers=auth)).json()["state"] == "idle"
        assert (await client.post("/v1/infer", json={"inputs": "a"})).status_code == 200


def test_admin_token_is_a_flag_and_kept_secret():
    settings = Settings(admin_token="s3cret")
    assert "s3cret" not in repr(settings)
    assert settings.admin_token.get_secret_value() == "s3cret"


def test_app_builds_without_admin_router_by_default():
    app = create_app(Settings())
    assert not any(getattr(r, "path", "").startswith("/admin") for r in app.routes)


async def test_admin_token_works_alongside_an_api_key(registry, tmp_path):
    """The admin endpoints take the admin token; the API keeps taking the API key."""
    async with running(
        ScriptedModel(), registry, api_key="K123", admin_token="T456", profile_dir=str(tmp_path)
    ) as client:
        admin = await client.post(
            "/admin/profile", json={"num_batches": 1}, headers={"Authorization": "Bearer T456"}
        )
        assert admin.status_code == 202, admin.text
        api_key = await client.get("/admin/profile", headers={"Authorization": "Bearer K123"})
        body = assert_error(api_key, 401, "unauthorized")
        assert body["error"] == "admin endpoints need the admin bearer token"
        assert_error(await client.get("/admin/profile"), 401, "unauthorized")
        infer = await client.post(
            "/v1/infer", json={"inputs": "a"}, headers={"Authorization": "Bearer K123"}
        )
        assert infer.status_code == 200
        admin_on_api = await client.post(
            "/v1/infer", json={"inputs": "a"}, headers={"Authorization": "Bearer T456"}
        )
        assert_error(admin_on_api, 401, "unauthorized")
