"""Disconnects, liveness, drain and over-limit streams against real uvicorn on a loopback
socket, over a gated scripted model so every interleaving is deterministic."""

import json
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.inprocess import codes, gated
from tests.rawhttp import read_response, send_request

TIMEOUT = 10  # guards against hangs only


def post(url, body, **kwargs):
    return httpx.post(f"{url}/v1/infer", json=body, timeout=30, **kwargs)


def errors_logged(caplog):
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_disconnect_while_queued_removes_the_items_before_compute(caplog):
    with gated(max_wait_ms=0) as (live, model, gate), ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(post, live.url, {"inputs": "first"})
        assert model.entered.wait(TIMEOUT)
        sock = send_request(live.port, b'{"inputs": ["abandoned one", "abandoned two"]}')
        live.wait_for(lambda: live.sample("batchfit_queue_depth") == 2)
        sock.close()
        live.wait_for(
            lambda: live.sample("batchfit_cancelled_items_total", {"stage": "queued"}) == 2
        )
        assert live.sample("batchfit_queue_depth") == 0
        gate.set()
        assert blocker.result().status_code == 200
        assert post(live.url, {"inputs": "after"}).json()["outputs"] == ["out:after"]
        assert live.sample("batchfit_open_items") == 0
    assert not any(text.startswith("abandoned") for text in model.seen)
    assert live.sample("batchfit_cancelled_items_total", {"stage": "running"}) == 0
    assert codes(live) == {"200": 2, "499": 1}
    assert errors_logged(caplog) == []


def test_disconnect_while_running_drops_the_orphan_quietly(caplog):
    settings = {"max_wait_ms": 1000, "max_batch_size": 2}
    with gated(**settings) as (live, model, gate), ThreadPoolExecutor(2) as pool:
        sock = send_request(live.port, b'{"inputs": "abandoned while running"}')
        live.wait_for(lambda: live.sample("batchfit_queue_depth") == 1)
        other = pool.submit(post, live.url, {"inputs": "stays"})
        assert model.entered.wait(TIMEOUT)  # the batch of both is on the model thread
        sock.close()
        live.wait_for(lambda: live.sample("batchfit_open_items") == 1)
        gate.set()
        assert other.result().json()["outputs"] == ["out:stays"]
        live.wait_for(
            lambda: live.sample("batchfit_cancelled_items_total", {"stage": "running"}) == 1
        )
    assert model.batch_sizes[-1] == 2
    assert "abandoned while running" in model.seen  # it ran; its result was dropped
    assert live.sample("batchfit_cancelled_items_total", {"stage": "queued"}) == 0
    assert codes(live) == {"200": 1, "499": 1}
    assert errors_logged(caplog) == []


def test_live_answers_while_the_model_is_busy():
    with gated() as (live, model, gate), ThreadPoolExecutor(1) as pool:
        busy = pool.submit(post, live.url, {"inputs": "long"})
        assert model.entered.wait(TIMEOUT)
        response = httpx.get(f"{live.url}/health/live", timeout=2)
        assert response.json() == {"status": "live"}
        assert httpx.get(f"{live.url}/health/ready", timeout=2).status_code == 200
        assert not busy.done()
        gate.set()
        assert busy.result().status_code == 200


def test_drain_finishes_admitted_work_and_refuses_new_work():
    with (
        gated(max_batch_size=1, max_wait_ms=0, drain_timeout_s=30) as (live, model, gate),
        ThreadPoolExecutor(3) as pool,
    ):
        running = pool.submit(post, live.url, {"inputs": "running"})
        assert model.entered.wait(TIMEOUT)
        queued = [pool.submit(post, live.url, {"inputs": [f"queued {i}"]}) for i in range(2)]
        live.wait_for(lambda: live.sample("batchfit_queue_depth") == 2)

        live.server.handle_exit(signal.SIGTERM, None)
        live.wait_for(lambda: live.sample("batchfit_draining") == 1)
        ready = httpx.get(f"{live.url}/health/ready", timeout=2)
        assert ready.status_code == 503 and ready.json()["error_type"] == "draining"
        refused = post(live.url, {"inputs": "new"})
        assert refused.status_code == 503
        assert refused.json()["error_type"] == "draining"
        assert refused.headers["retry-after"] == "1"
        assert not running.done()

        gate.set()
        assert running.result().json()["outputs"] == ["out:running"]
        assert sorted(f.result().json()["outputs"][0] for f in queued) == [
            "out:queued 0", "out:queued 1",
        ]  # fmt: skip
        live.thread.join(TIMEOUT)
        assert not live.thread.is_alive()  # the drain ended the server by itself
    assert "new" not in model.seen
    assert live.sample("batchfit_rejections_total", {"reason": "draining"}) == 1


def test_drain_timeout_answers_leftovers_with_503(caplog):
    with (
        gated(max_batch_size=1, max_wait_ms=0, drain_timeout_s=0.2) as (live, model, gate),
        ThreadPoolExecutor(2) as pool,
    ):
        running = pool.submit(post, live.url, {"inputs": "running"})
        assert model.entered.wait(TIMEOUT)
        queued = pool.submit(post, live.url, {"inputs": "queued"})
        live.wait_for(lambda: live.sample("batchfit_queue_depth") == 1)
        live.server.handle_exit(signal.SIGTERM, None)
        for future in (running, queued):
            response = future.result()
            assert response.status_code == 503
            assert response.json()["error_type"] == "draining"
        gate.set()  # lets the model thread finish so the process can stop
        live.thread.join(TIMEOUT)
        assert not live.thread.is_alive()
    assert "queued" not in model.seen
    assert any("drain timeout" in r.getMessage() for r in caplog.records)


def test_second_signal_answers_leftovers_and_stops_without_waiting(caplog):
    with gated(drain_timeout_s=300) as (live, model, gate), ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(post, live.url, {"inputs": "stuck"})
        assert model.entered.wait(TIMEOUT)
        live.server.handle_exit(signal.SIGTERM, None)
        live.wait_for(lambda: live.sample("batchfit_draining") == 1)
        live.server.handle_exit(signal.SIGTERM, None)
        live.thread.join(TIMEOUT)
        assert not live.thread.is_alive()  # while the model is still stuck
        response = stuck.result()
        assert response.status_code == 503 and response.json()["error_type"] == "draining"
        gate.set()
    assert errors_logged(caplog) == []


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_over_limit_body_is_refused_before_it_is_all_sent(declared):
    limit = 64 * 1024
    with gated(max_body_bytes=limit) as (live, model, gate):
        gate.set()
        warm_up_batches = len(model.batch_sizes)
        if declared:
            # Only the headers go out: the 413 comes before any of the body.
            sock = send_request(live.port, headers={"Content-Length": str(100 * limit)},
                                content_length=False)  # fmt: skip
        else:
            sock = send_request(live.port, headers={"Transfer-Encoding": "chunked"},
                                content_length=False)  # fmt: skip
            chunk = b"x" * 8192
            # Twice the limit, and never the final empty chunk: a server that waited for the
            # whole body would never answer.
            for _ in range(2 * limit // len(chunk)):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, _, body = read_response(sock)
        sock.close()
        assert status == 413
        assert json.loads(body)["error_type"] == "payload_too_large"
        assert post(live.url, {"inputs": "still serving"}).status_code == 200
        assert len(model.batch_sizes) == warm_up_batches + 1  # only the last request ran


def test_overload_rejects_exactly_the_excess_fast_and_admitted_work_completes():
    settings = {"max_batch_size": 2, "max_wait_ms": 1000, "max_queue_items": 4,
                "max_inputs_per_request": 4}  # fmt: skip
    with gated(**settings) as (live, model, gate), ThreadPoolExecutor(6) as pool:
        running = [pool.submit(post, live.url, {"inputs": f"running {i}"}) for i in range(2)]
        assert model.entered.wait(TIMEOUT)  # a full batch of 2 is on the model thread
        queued = [pool.submit(post, live.url, {"inputs": f"queued {i}"}) for i in range(4)]
        live.wait_for(lambda: live.sample("batchfit_queue_depth") == 4)

        k = 5
        with httpx.Client(base_url=live.url, timeout=5) as client:
            rejected = [client.post("/v1/infer", json={"inputs": f"excess {i}"})
                        for i in range(k)]  # fmt: skip
        for response in rejected:
            assert response.status_code == 429
            assert response.json()["error_type"] == "overloaded"
            assert int(response.headers["retry-after"]) >= 1
            assert response.elapsed.total_seconds() < 1.0
        assert live.sample("batchfit_rejections_total", {"reason": "queue_full"}) == k

        gate.set()
        for future in running + queued:
            assert future.result().status_code == 200
    assert not any(text.startswith("excess") for text in model.seen)
    assert sorted(model.seen[-6:]) == sorted([f"running {i}" for i in range(2)]
                                             + [f"queued {i}" for i in range(4)])  # fmt: skip


def test_expired_item_is_dropped_and_the_ones_behind_it_still_batch():
    with (
        gated(max_batch_size=4, max_wait_ms=0) as (live, model, gate),
        ThreadPoolExecutor(4) as pool,
    ):
        blocker = pool.submit(post, live.url, {"inputs": "blocker"})
        assert model.entered.wait(TIMEOUT)
        late = pool.submit(post, live.url, {"inputs": "late"}, headers={"X-Timeout-S": "0.2"})
        live.wait_for(lambda: live.sample("batchfit_queue_depth") == 1)
        behind = [pool.submit(post, live.url, {"inputs": f"behind {i}"}) for i in range(2)]
        response = late.result()
        assert response.status_code == 504
        assert response.json()["error_type"] == "deadline_exceeded"
        live.wait_for(lambda: live.sample("batchfit_queue_depth") == 2)
        gate.set()
        assert blocker.result().status_code == 200
        assert [f.result().json()["outputs"] for f in behind] == [["out:behind 0"],
                                                                  ["out:behind 1"]]  # fmt: skip
    assert "late" not in model.seen
    assert model.batch_sizes[-1] == 2, model.batch_sizes  # the two behind it ran together
