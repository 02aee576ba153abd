"""The real replica (bundled model, uvicorn, a real process): SIGTERM drain, auth, bad input."""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.fakes import BREAK_THE_LOOP, DEVICE_FAULT, GATE_ENV, STALL_THE_LOOP
from tests.rawhttp import read_response, send_request
from tests.servers import queue_depth, run_server, wait_ready

pytestmark = pytest.mark.integration

TEXT = "Batching requests makes inference on accelerators much cheaper and faster overall. " * 4


def gauge(url: str, name: str) -> float:
    scrape = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", scrape, re.MULTILINE)
    assert match, f"{name} not in scrape"
    return float(match.group(1))


def poll(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path):
    num_requests = 6
    with run_server(
        tmp_path, "--max-batch-size", "8", "--max-wait-ms", "0", "--drain-timeout-s", "240",
        "--max-queue-items", "512",
    ) as server, ThreadPoolExecutor(num_requests) as pool:  # fmt: skip
        reference = httpx.post(f"{server.url}/v1/infer", json={"inputs": TEXT}, timeout=60)
        expected = np.asarray(reference.json()["outputs"][0])

        def one(i: int) -> httpx.Response:
            body = {"inputs": [f"{i} {TEXT}"] * 7 + [TEXT]}
            return httpx.post(f"{server.url}/v1/infer", json=body, timeout=300)

        futures = [pool.submit(one, i) for i in range(num_requests)]
        poll(lambda: gauge(server.url, "batchfit_active_infer_requests") == num_requests)
        server.process.send_signal(signal.SIGTERM)

        poll(lambda: httpx.get(f"{server.url}/health/ready", timeout=10).status_code == 503)
        ready = httpx.get(f"{server.url}/health/ready", timeout=10)
        assert ready.json()["error_type"] == "draining"
        refused = httpx.post(f"{server.url}/v1/infer", json={"inputs": "new"}, timeout=10)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error_type"] == "draining"
        assert refused.headers["retry-after"] == "1"
        # Work was still in progress when the new request was refused.
        assert not all(f.done() for f in futures)

        for future in futures:
            response = future.result()
            assert response.status_code == 200, response.text
            outputs = response.json()["outputs"]
            assert len(outputs) == 8
            assert float(np.asarray(outputs[-1]) @ expected) >= 0.9999
        assert server.process.wait(60) == 0
    log = server.log()
    assert "drained: every admitted request was answered" in log
    assert "Traceback" not in log


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed")
    keys = tmp / "keys"
    keys.write_text("integration-key\n")
    with run_server(tmp, "--api-key-file", str(keys), "--max-body-bytes", "65536") as server:
        yield server


AUTH = {"Authorization": "Bearer integration-key"}


def test_api_key_on_the_real_server(keyed_server):
    url = keyed_server.url
    denied = httpx.post(f"{url}/v1/infer", json={"inputs": "a"})
    assert denied.status_code == 401
    assert denied.headers["www-authenticate"] == "Bearer"
    assert denied.json()["error_type"] == "unauthorized"
    ok = httpx.post(f"{url}/v1/infer", json={"inputs": "a"}, headers=AUTH, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["outputs"][0]) == 384
    assert httpx.get(f"{url}/health/ready").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        (b'{"inputs": "caf\xe9 au lait"}', 400, "invalid_json"),
        (b'{"inputs": ["fine", "\\udc80 broken"]}', 422, "invalid_request"),
        (b'{"inputs": "a", "timeout_s": -5}', 422, "invalid_request"),
        (b'{"inputs": "a", "timeout_s": NaN}', 422, "invalid_request"),
        (b'{"inputs": "a", "timeout_s": 1e999}', 422, "invalid_request"),
        (b'{"inputs": "a", "priority": 99}', 422, "invalid_request"),
        (b'{"inputs": null}', 422, "invalid_request"),
        (b'{"inputs": [["nested"]]}', 422, "invalid_request"),
    ],
)
def test_bad_input_on_the_real_model(keyed_server, body, status, error_type):
    url = keyed_server.url
    headers = {**AUTH, "content-type": "application/json"}
    response = httpx.post(f"{url}/v1/infer", content=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["error_type"] == error_type
    after = httpx.post(f"{url}/v1/infer", json={"inputs": "next"}, headers=AUTH, timeout=60)
    assert after.status_code == 200


def test_absurd_timeout_is_accepted_on_the_real_model(keyed_server):
    """A huge timeout is served, not refused (the capped deadline it gets: test_guards)."""
    for body in ({"inputs": "a", "timeout_s": 1e300}, {"inputs": "a"}):
        headers = {**AUTH, "X-Timeout-S": "1e308"}
        response = httpx.post(f"{keyed_server.url}/v1/infer", json=body, headers=headers)
        assert response.status_code == 200, response.text


def test_chunked_over_limit_body_on_the_real_server(keyed_server):
    sock = send_request(
        keyed_server.port, content_length=False,
        headers={**AUTH, "Transfer-Encoding": "chunked"},
    )  # fmt: skip
    chunk = b"y" * 16384
    try:
        for _ in range(8):  # twice the 64 KiB limit, never the final chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may already have answered and closed
    status, _, body = read_response(sock)
    sock.close()
    assert status == 413 and b"payload_too_large" in body
    wait_ready(keyed_server, 30)


def test_health_live_answers_while_the_model_is_busy(keyed_server):
    url = keyed_server.url
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(
            httpx.post, f"{url}/v1/infer", headers=AUTH, timeout=300,
            json={"inputs": [f"{i} {TEXT}" for i in range(64)]},
        )  # fmt: skip
        poll(lambda: gauge(url, "batchfit_open_items") > 0)
        live = httpx.get(f"{url}/health/live", timeout=2)
        assert live.json() == {"status": "live"}
        assert busy.result().status_code == 200


def test_log_and_errors_carry_no_input_text(keyed_server):
    secret = "zebra-quartz-secret"
    url = keyed_server.url
    bodies = [
        {"inputs": secret},
        {"inputs": f"{secret} " * 400, "truncate": False},
        {"inputs": [secret, 3]},
        {"inputs": secret, "priority": secret},
    ]
    for body in bodies:
        response = httpx.post(f"{url}/v1/infer", json=body, headers=AUTH, timeout=60)
        assert response.status_code in (200, 413, 422), response.text
        if response.status_code != 200:
            assert secret not in response.text
    assert secret not in keyed_server.log()


def test_a_crashed_batcher_loop_exits_1_with_a_traceback(tmp_path):
    with run_server(
        tmp_path, "--model", "python:tests.fakes:loop_breaking_model", "--sizer", "fixed",
        ready_timeout_s=60,
    ) as server:  # fmt: skip
        fine = httpx.post(f"{server.url}/v1/infer", json={"inputs": "fine"}, timeout=30)
        assert fine.json()["outputs"] == ["out:fine"]
        crash = httpx.post(f"{server.url}/v1/infer", json={"inputs": BREAK_THE_LOOP}, timeout=30)
        assert crash.status_code == 500, crash.text
        assert crash.json()["error_type"] == "internal_error"
        assert server.process.wait(30) == 1
    log = server.log()
    assert "the batcher crashed; stopping the replica" in log
    assert "Traceback (most recent call last)" in log
    assert "TypeError" in log


def test_a_device_error_fails_what_the_replica_holds_and_exits_1(tmp_path):
    """Not ready is not enough: /health/live would keep answering, so neither the kubelet nor
    ``batchfit up`` would ever restart a replica whose device failed."""
    folder = tmp_path / "fault"
    folder.mkdir()
    with (
        run_server(
            tmp_path, "--model", "python:tests.fakes:faulty_device_model", "--sizer", "fixed",
            ready_timeout_s=60, env={"BATCHFIT_TEST_FAULT_DIR": str(folder)},
        ) as server,
        ThreadPoolExecutor(4) as pool,
    ):  # fmt: skip
        assert httpx.post(f"{server.url}/v1/infer", json={"inputs": "fine"}).status_code == 200

        def infer(inputs):
            return httpx.post(f"{server.url}/v1/infer", json={"inputs": inputs}, timeout=60)

        fault = pool.submit(infer, DEVICE_FAULT)
        deadline = time.monotonic() + 30
        while not (folder / "entered").exists():  # the faulty batch is on the device
            assert time.monotonic() < deadline and not fault.done()
            time.sleep(0.01)
        queued = [pool.submit(infer, [f"queued {i}", "x"]) for i in range(3)]
        while queue_depth(f"{server.url}/metrics") < 6:  # all three wait behind it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (folder / "release").touch()
        answers = [fault.result(), *(f.result() for f in queued)]
        assert server.process.wait(30) == 1
    for answer in answers:
        assert answer.status_code == 500, answer.text
        assert answer.json()["error"] == "the device failed; this replica is stopping"
    log = server.log()
    assert (
        "device error: CUDA error: an illegal memory access was encountered; stopping the "
        "replica for a restart" in log
    )
    assert "Traceback" not in log


def test_a_hung_event_loop_writes_every_stack_and_exits_1(tmp_path):
    """A hung replica stays alive answering nothing; under Docker Compose, whose restart
    policy sees only exits, it would stay so for good."""
    with (
        run_server(
            tmp_path, "--model", "python:tests.fakes:loop_breaking_model", "--sizer", "fixed",
            "--hang-timeout-s", "2", ready_timeout_s=60,
        ) as server,
        ThreadPoolExecutor(1) as pool,
    ):  # fmt: skip
        time.sleep(6)  # idle for three timeouts: a loop that waits is not hung
        fine = httpx.post(f"{server.url}/v1/infer", json={"inputs": "fine"}, timeout=30)
        assert fine.json()["outputs"] == ["out:fine"]
        stalled = pool.submit(
            httpx.post, f"{server.url}/v1/infer", json={"inputs": STALL_THE_LOOP}, timeout=60
        )  # fmt: skip
        assert server.process.wait(30) == 1  # not the 120 s the stall lasts
        with pytest.raises(httpx.TransportError):  # its connection went with the process
            stalled.result()
    log = server.log()
    assert "Timeout (0:00:02)!" in log
    assert "in scripted_items" in log  # where the loop was stuck, in its stack


def test_a_forward_pass_past_its_exit_bound_ends_the_replica_with_every_stack(tmp_path):
    """Liveness says a forward pass is hung, but under Docker Compose nothing asks: the
    replica ends itself, later, for the restart policy that sees only exits."""
    gate = tmp_path / "gate"  # never made: the held pass would wait 120 s
    with (
        run_server(
            tmp_path, "--model", "python:tests.fakes:file_gated_model", "--sizer", "fixed",
            "--forward-timeout-s", "1", "--forward-exit-s", "3", ready_timeout_s=60,
            env={GATE_ENV: str(gate)},
        ) as server,
        ThreadPoolExecutor(1) as pool,
    ):  # fmt: skip
        held = pool.submit(
            httpx.post, f"{server.url}/v1/infer", json={"inputs": "hold it"}, timeout=60
        )  # fmt: skip
        started = time.monotonic()
        poll(lambda: httpx.get(f"{server.url}/health/live", timeout=10).status_code == 503, 30)
        assert server.process.wait(30) == 1
        ended_s = time.monotonic() - started
        with pytest.raises(httpx.TransportError):  # its connection went with the process
            held.result()
    log = server.log()
    assert "past --forward-exit-s 3: the device or the model is hung" in log
    assert "most recent call first" in log and "in forward" in log  # the held pass's stack
    assert 2 <= ended_s < 20, ended_s


def test_a_forward_pass_past_its_timeout_fails_liveness_until_it_returns(tmp_path):
    """A hung device holds the model thread: the event loop answers on, so only a liveness
    that looks at the model thread gets the replica restarted."""
    gate = tmp_path / "gate"
    gate.touch()
    with (
        run_server(
            tmp_path, "--model", "python:tests.fakes:file_gated_model", "--sizer", "fixed",
            "--forward-timeout-s", "1", ready_timeout_s=60, env={GATE_ENV: str(gate)},
        ) as server,
        ThreadPoolExecutor(1) as pool,
    ):  # fmt: skip
        live = f"{server.url}/health/live"
        assert httpx.get(live, timeout=10).status_code == 200
        gate.unlink()
        held = pool.submit(
            httpx.post, f"{server.url}/v1/infer", json={"inputs": "hold it"}, timeout=60
        )  # fmt: skip
        poll(lambda: httpx.get(live, timeout=10).status_code == 503, 30)
        hung = httpx.get(live, timeout=10)
        v2 = httpx.get(f"{server.url}/v2/health/live", timeout=10)
        gate.touch()
        assert held.result(60).status_code == 200
        poll(lambda: httpx.get(live, timeout=10).status_code == 200, 30)
    assert hung.json()["error_type"] == "model_hung" and hung.headers["retry-after"] == "1"
    assert "--forward-timeout-s 1" in hung.json()["error"]
    assert (v2.status_code, v2.json()) == (503, {"live": False})
