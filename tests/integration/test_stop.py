"""Stopping a replica at any moment: SIGTERM while its model loads or while warm-up runs a
batch (a forward pass in progress cannot be interrupted) ends the process promptly, with a
log line saying where it stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from bench.servers import free_port
from tests.fakes import HOLD_LOAD_ENV, SLOW_FORWARD_ENV
from tests.servers import ROOT

pytestmark = pytest.mark.integration

# A guard against hangs, not the bound: the product's bound is 5 s (docs/memory.md). Before,
# such a replica drained, then waited for the forward pass until killed.
GUARD_S = 30


def start(tmp_path, model, env):
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1",
             "--port", str(free_port()), "--model", model],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    return process, log


def wait_for(path, process, log):
    deadline = time.monotonic() + GUARD_S * 2
    while not path.exists():
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def stop_and_time(process) -> float:
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(GUARD_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
        pytest.fail(f"still running {GUARD_S}s after SIGTERM")
    return time.monotonic() - started


def test_sigterm_during_a_warm_up_batch_exits_and_says_where(tmp_path):
    import os

    marker = tmp_path / "forward-started"
    env = {**os.environ, SLOW_FORWARD_ENV: str(marker)}
    process, log = start(tmp_path, "python:tests.fakes:slow_warm_up_model", env)
    try:
        wait_for(marker, process, log)  # a 120 s warm-up batch is running
        took = stop_and_time(process)
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    print(f"\nexited {took:.1f}s after SIGTERM during a warm-up batch")
    assert process.returncode == 0, text
    assert (
        "stopped while warming up model scripted (a batch of 32 x 32 tokens running); "
        "not waiting for the model thread" in text
    ), text
    assert "exiting without waiting for the model thread to finish" in text


def test_sigterm_while_the_model_loads_exits_and_says_where(tmp_path):
    import os

    release = tmp_path / "never"  # the load waits for it (60 s at most)
    env = {**os.environ, HOLD_LOAD_ENV: str(release)}
    model = "python:tests.fakes:held_loading_model"
    process, log = start(tmp_path, model, env)
    try:
        deadline = time.monotonic() + GUARD_S * 2
        while "listening on" not in log.read_text():  # serving /health/live, loading
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        took = stop_and_time(process)
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    print(f"\nexited {took:.1f}s after SIGTERM while loading")
    assert process.returncode == 0, text
    assert f"stopped while loading model {model}; not waiting for the model thread" in text, text
