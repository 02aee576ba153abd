"""Connections at their edges, on real uvicorn over loopback (server/one_write.py): a client
that goes away after a large body, a pipelined request's flow control, and a client stalled
half-way through its body when the replica stops."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fakes import GATE_ENV, ScriptedModel
from tests.inprocess import codes, gated, serve_in_thread
from tests.rawhttp import read_response, send_request
from tests.servers import ROOT, run_server

pytestmark = pytest.mark.integration

TIMEOUT = 10  # guards against hangs only
NUM_INPUTS = 64


def post(url, body):
    return httpx.post(f"{url}/v1/infer", json=body, timeout=30)


def errors_logged(caplog):
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def connection_of(live, port: int):
    """The server's protocol object for the client connection from local port ``port``."""
    for connection in list(live.server.server_state.connections):
        if connection.client is not None and connection.client[1] == port:
            return connection
    return None


# Each size failed before, most times (every input ran, answered 200): once more than 64 KiB
# of body waits unread, uvicorn stops reading the socket until the app asks for more, which
# it never does after the body's last bytes, so the client's close went unread. Whether the
# last reads leave it so depends on how the body arrives: several sizes, one after another.
BODY_BYTES = (300_000, 400_000, 600_000, 1_500_000)


def test_a_client_gone_after_a_large_body_is_noticed_before_compute(caplog):
    with gated(max_wait_ms=0) as (live, model, gate), ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(post, live.url, {"inputs": "first"})
        assert model.entered.wait(TIMEOUT)
        for attempt, body_bytes in enumerate(BODY_BYTES, start=1):
            text = "x" * (body_bytes // NUM_INPUTS)  # one word: a short input for the model
            body = json.dumps({"inputs": [f"{text}{i}" for i in range(NUM_INPUTS)]}).encode()
            with send_request(live.port, body):
                live.wait_for(lambda: live.sample("batchfit_queue_depth") == NUM_INPUTS)
            cancelled = attempt * NUM_INPUTS
            try:
                live.wait_for(
                    lambda c=cancelled: (
                        live.sample("batchfit_cancelled_items_total", {"stage": "queued"}) == c
                    ),
                    TIMEOUT,
                )
            except TimeoutError:
                pytest.fail(f"a client gone after a body of {len(body)} bytes went unnoticed")
        gate.set()
        assert blocker.result().status_code == 200
        live.wait_for(lambda: live.sample("batchfit_open_items") == 0, TIMEOUT)
    assert not any(seen.startswith("xxx") for seen in model.seen)
    assert codes(live) == {"200": 1, "499": len(BODY_BYTES)}
    assert errors_logged(caplog) == []


def test_a_pipelined_request_keeps_reading_paused_until_the_one_before_is_answered():
    def request(body: bytes) -> bytes:
        return (
            b"POST /v1/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )

    with gated(max_wait_ms=0) as (live, model, gate):
        sock = socket.create_connection(("127.0.0.1", live.port), timeout=TIMEOUT)
        with sock:
            sock.sendall(request(b'{"inputs": "first"}'))
            assert model.entered.wait(TIMEOUT)  # read, and on the model thread
            sock.sendall(request(b'{"inputs": "second"}'))  # pipelined behind it
            port = sock.getsockname()[1]

            def second_read_and_queued() -> bool:
                connection = connection_of(live, port)
                return (
                    connection is not None
                    and len(connection.pipeline) == 1
                    and not connection.cycle.more_body
                )

            live.wait_for(second_read_and_queued, TIMEOUT)
            # Its body is complete, but the request before it is still running: reading
            # stays paused, as uvicorn has it (resuming at the end of a body must not lift
            # this, or a client could pile up requests unread).
            assert connection_of(live, port).flow.read_paused
            gate.set()
            answers = [read_response(sock) for _ in range(2)]
    assert [status for status, _, _ in answers] == [200, 200]
    outputs = [json.loads(body)["outputs"] for _, _, body in answers]
    assert outputs == [["out:first"], ["out:second"]]


def assert_draining_answer(status, headers, body) -> None:
    assert status == 503, body
    assert headers["content-type"] == "application/json"
    assert "retry-after" in headers
    assert headers.get("connection") == "close"
    error = json.loads(body)
    assert set(error) == {"error", "error_type", "request_id"}
    assert error["error_type"] == "draining"
    assert error["request_id"] == headers["x-request-id"]


def stalled_request(port: int) -> socket.socket:
    """Headers declaring 1000 bytes of body, then 60 of them, then nothing."""
    sock = send_request(
        port, b'{"inputs": ["' + b"a" * 47, content_length=False,
        headers={"Content-Length": "1000", "X-Request-ID": "stalled-1"},
    )  # fmt: skip
    sock.settimeout(TIMEOUT)
    return sock


def test_a_client_stalled_in_its_body_gets_503_draining_once_the_drain_is_over(caplog):
    with serve_in_thread(ScriptedModel(), drain_timeout_s=30) as live:
        sock = stalled_request(live.port)
        with sock:
            live.wait_for(lambda: live.sample("batchfit_requests_in_flight") == 1, TIMEOUT)
            live.server.handle_exit(signal.SIGTERM, None)
            status, headers, body = read_response(sock)
            assert_draining_answer(status, headers, body)
            assert json.loads(body)["request_id"] == "stalled-1"
            assert sock.recv(1) == b""  # and its connection closed
        live.thread.join(TIMEOUT)
        assert not live.thread.is_alive()
    assert live.sample("batchfit_requests_in_flight") == 0
    assert errors_logged(caplog) == []


def test_sigterm_with_a_stalled_client_exits_cleanly_and_answers_it_503(tmp_path):
    """As an operator's replica does (``batchfit serve``): before, the process waited
    uvicorn's fixed 10 s graceful-shutdown timeout whatever --drain-timeout-s said, then
    answered the client a plain-text 500 and logged a traceback."""
    gate = tmp_path / "gate"
    with run_server(
        tmp_path, "--model", "python:tests.fakes:file_gated_model", "--drain-timeout-s", "1",
        env={GATE_ENV: str(gate)},
    ) as server:  # fmt: skip
        sock = stalled_request(server.port)
        with sock:

            def in_flight() -> float:
                scrape = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
                line = next(
                    line for line in scrape.splitlines()
                    if line.startswith("batchfit_requests_in_flight ")
                )  # fmt: skip
                return float(line.split()[1])

            # The scrape counts itself: more than one is the stalled request too.
            deadline = time.monotonic() + TIMEOUT
            while in_flight() < 2:
                assert time.monotonic() < deadline, "the stalled request never reached the app"
                time.sleep(0.02)
            server.process.send_signal(signal.SIGTERM)
            status, headers, body = read_response(sock)
            assert_draining_answer(status, headers, body)
            assert sock.recv(1) == b""
        try:
            code = server.process.wait(30)  # a guard; it exits within a few seconds
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after SIGTERM:\n{server.log()}")
    log = server.log()
    assert code == 0, log
    assert "ERROR" not in log and "Traceback" not in log, log


class ConfigBuilt(Exception):
    pass


def test_the_shutdown_after_the_drain_fits_the_pods_grace_period(monkeypatch):
    """preStop + the longest drain + the graceful shutdown uvicorn then allows fit in the
    pod's terminationGracePeriodSeconds (before: 5 + 30 + 5 + 10 = 50 s of 45)."""
    import uvicorn
    import yaml

    from server import Settings, cli

    captured: dict[str, object] = {}

    def config(app, **kwargs):
        captured.update(kwargs)
        raise ConfigBuilt

    monkeypatch.setattr(uvicorn, "Config", config)
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    monkeypatch.setattr(cli, "_busy_port", lambda settings: None)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")  # serve() sets it otherwise
    with pytest.raises(ConfigBuilt):
        cli.serve(Settings())
    deployment = yaml.safe_load((ROOT / "deploy/kubernetes/base/deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop_s = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
    env = {item["name"]: item.get("value") for item in container["env"]}
    drain_s = float(env["BATCHFIT_DRAIN_TIMEOUT_S"])
    aborted_answers_s = 5.0  # Runtime.drain waits this long for aborted work's 503s
    graceful_s = captured["timeout_graceful_shutdown"]
    assert isinstance(graceful_s, int | float) and graceful_s > 0
    total_s = pre_stop_s + drain_s + aborted_answers_s + graceful_s
    assert total_s < pod["terminationGracePeriodSeconds"]
