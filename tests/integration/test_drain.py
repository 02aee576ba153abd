"""Draining behind real Nginx: SIGTERM one replica in the middle of a load run."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.launch import pid_exists, run_launcher
from tests.loadrun import LoadRun, access_log, load_run, served_by, shares

pytestmark = pytest.mark.integration

LOAD_REQUESTS = 300
LOAD_CLIENTS = 6
VICTIM = "replica-1"
# Sent to the victim itself just before SIGTERM: admitted work that keeps it draining long
# enough for Nginx to send it new requests, which it must refuse (503) for Nginx to retry.
HELD_INPUTS = 128
HELD_TEXT = "Batching requests makes inference on accelerators much cheaper and faster. " * 4


def open_items(metrics_url: str) -> float:
    scrape = httpx.get(metrics_url, timeout=10).text
    return float(re.search(r"^batchfit_open_items (\S+)$", scrape, re.MULTILINE).group(1))


def test_sigterm_mid_run_drains_and_no_client_sees_a_failure(tmp_path):
    with run_launcher(
        tmp_path, "--max-batch-size", "8", "--rate-limit-rps", "1000",
        "--rate-limit-burst", "1000", "--drain-timeout-s", "20", "--no-restart", replicas=3,
    ) as cluster, ThreadPoolExecutor(2) as pool:  # fmt: skip
        victim_url, victim_pid = cluster.replicas[VICTIM]
        victim = cluster.address(VICTIM)
        state: dict[str, object] = {"terminated_at": None, "held_done_at_kill": None}
        progress = LoadRun()

        def terminate_while_holding_work() -> None:
            while len(progress.outcomes) < LOAD_REQUESTS // 5:
                time.sleep(0.01)
            body = {"inputs": [f"{i} {HELD_TEXT}" for i in range(HELD_INPUTS)]}
            held = pool.submit(httpx.post, f"{victim_url}/v1/infer", json=body, timeout=120)
            state["held"] = held
            deadline = time.monotonic() + 60
            while open_items(cluster.metrics_urls[VICTIM]) < HELD_INPUTS // 2:
                assert time.monotonic() < deadline and not held.done(), "held work not seen"
                time.sleep(0.005)
            os.kill(victim_pid, signal.SIGTERM)
            state["terminated_at"] = len(progress.outcomes)
            state["held_done_at_kill"] = held.done()

        killer = pool.submit(terminate_while_holding_work)
        # Several inputs per request, so the victim holds admitted work when the signal lands.
        run = asyncio.run(
            load_run(cluster.url, requests=LOAD_REQUESTS, clients=LOAD_CLIENTS,
                     prefix="drain", inputs_per_request=4, run=progress)
        )  # fmt: skip
        killer.result(60)
        held_response = state["held"].result(120)
        entries = access_log(cluster.access_log_path, "drain", expect=LOAD_REQUESTS)
        deadline = time.monotonic() + 30
        while pid_exists(victim_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        launcher_log = cluster.errors()
        victim_log = (cluster.workdir / f"{VICTIM}.log").read_text(errors="replace")

    assert state["terminated_at"] is not None
    assert run.failures == [], run.failures[:5]
    assert len(entries) == LOAD_REQUESTS
    # The victim drained and exited cleanly (the launcher reports its exit status).
    assert re.search(rf"{VICTIM} \(pid \d+\) exited with 0\b", launcher_log), launcher_log[-2000:]
    # The victim itself answered the work it had admitted when SIGTERM landed.
    assert state["held_done_at_kill"] is False
    assert held_response.status_code == 200, held_response.text
    assert len(held_response.json()["outputs"]) == HELD_INPUTS
    draining = re.search(r"draining: (\d+) requests with (\d+) items in progress", victim_log)
    assert draining and int(draining.group(2)) >= HELD_INPUTS // 2, victim_log[-2000:]
    assert "drained: every admitted request was answered" in victim_log, victim_log[-2000:]
    # Whatever the victim refused while draining (503) was retried on another replica.
    refused = [e for e in entries.values() if e["upstream_status"].startswith("503")]
    assert refused, "no request reached the victim while it drained"
    assert all(e["status"] == 200 and served_by(e) != victim for e in refused)
    share = shares(entries)
    figures = {name: share[cluster.address(name)] for name in cluster.replicas}
    print(f"\ndraining: {LOAD_REQUESTS} requests, {LOAD_CLIENTS} clients, "
          f"{len(run.failures)} failures; {VICTIM} got SIGTERM after {state['terminated_at']} "
          f"answers holding {draining.group(2)} items and exited 0 once it had answered them; "
          f"{len(refused)} requests it refused with 503 while draining were retried "
          f"elsewhere; per-replica share {figures}")  # fmt: skip
