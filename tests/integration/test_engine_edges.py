"""``--api-workers 2`` at the edges of the engine's life: a stopped engine takes the replica
out of readiness at once (not only out of liveness, seconds later), and inputs dropped from
the engine's queue at their deadline are counted as a client's are."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fakes import GATE_ENV
from tests.integration.test_api_workers import GATED, Gated, infer, poll, scrape, value
from tests.servers import ROOT, run_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edges")
    gate = folder / "gate"
    gate.touch()
    # PYTHONPATH: the API processes start with ``python -P`` (the working directory off
    # sys.path) and must unpickle the fake model's preparer from ``tests``.
    env = {GATE_ENV: str(gate), "PYTHONPATH": str(ROOT)}
    with run_server(folder, *GATED, "--api-workers", "2", env=env) as server:
        yield Gated(server, gate)


def statuses(url: str, path: str, times: int = 8) -> set[int]:
    # One connection each: the listening socket hands them to either API process.
    return {httpx.get(f"{url}{path}", timeout=10).status_code for _ in range(times)}


def test_a_stopped_engine_makes_every_api_process_not_ready_and_refuse_new_work(replica):
    url = replica.url
    assert statuses(url, "/health/ready") == {200}
    engine = replica.server.process.pid
    # NOTE: stopped for less than --hang-timeout-s (30 s) even when this fails: past it, the
    # engine's watchdog ends the replica as it resumes, and the next test with it.
    os.kill(engine, signal.SIGSTOP)
    try:
        poll(lambda: statuses(url, "/health/ready") == {503}, timeout_s=15)
        # Refused at once, not held for its deadline and the grace (65 s) by a silent engine.
        refused = infer(url, {"inputs": ["while stopped"], "timeout_s": 60}, timeout_s=5)
    finally:
        os.kill(engine, signal.SIGCONT)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error_type"] == "not_ready"
    poll(lambda: statuses(url, "/health/ready") == {200}, timeout_s=60)
    assert infer(url, {"inputs": ["after"]}).status_code == 200


def test_inputs_dropped_at_their_deadline_in_the_engine_are_counted(replica):
    labels = 'stage="queued"'
    with ThreadPoolExecutor(2) as pool, replica.held(pool):
        before = value(scrape(replica.url), "batchfit_cancelled_items_total", labels)
        late = infer(replica.url, {"inputs": ["late 1", "late 2", "late 3"], "timeout_s": 0.3})
        assert late.status_code == 504, late.text
        assert late.json()["error_type"] == "deadline_exceeded"
        assert "deadline of 0.3s" in late.json()["error"]  # the one the client gave
        poll(lambda: value(scrape(replica.url), "batchfit_queue_depth") == 0)
        after = value(scrape(replica.url), "batchfit_cancelled_items_total", labels)
    assert after - before == 3
