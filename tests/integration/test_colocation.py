"""A real replica holds its model thread on its event loop's CPU while forward passes are
light (the no-op model), read from the kernel (``/proc/PID/task/TID/status``). One computing
on the CPU moves no thread: ``test_server``."""

from __future__ import annotations

import os

import httpx
import pytest

from bench.comparisons import NOOP_MODEL
from tests.busy_threads import held_threads
from tests.ci import unavailable
from tests.servers import run_server

pytestmark = pytest.mark.integration


def send(url: str, count: int) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(count):
            answer = client.post("/v1/infer", json={"inputs": [f"text {i}"]})
            answer.raise_for_status()
            assert len(answer.json()["outputs"]) == 1


@pytest.fixture(autouse=True)
def two_cpus():
    if len(os.sched_getaffinity(0)) < 2:
        unavailable("moving threads between CPUs needs 2; this process may use 1")


def test_a_light_model_shares_the_event_loops_cpu(tmp_path):
    with run_server(tmp_path, "--model", NOOP_MODEL) as server:
        send(server.url, 50)
        held = held_threads(server.process.pid)
        log = server.log()
    pid = server.process.pid
    assert pid in held, (held, log[-3000:])  # the event loop runs on the main thread
    cpu = held[pid]
    assert len(cpu) == 1
    assert sorted(held.values()) == [cpu, cpu], held  # it and the model thread, no other
    assert f"the model thread shares CPU {next(iter(cpu))} with the event loop" in log
