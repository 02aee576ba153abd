"""Draining behind real Nginx: SIGTERM one replica in the middle of a load run."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from tests.launch import pid_exists, run_launcher
from tests.loadrun import LoadRun, access_log, load_run, served_by, shares

pytestmark = pytest.mark.integration

LOAD_REQUESTS = 300
LOAD_CLIENTS = 6
VICTIM = "replica-1"


def test_sigterm_mid_run_drains_and_no_client_sees_a_failure(tmp_path):
    with run_launcher(
        tmp_path, "--max-batch-size", "8", "--rate-limit-rps", "1000",
        "--rate-limit-burst", "1000", "--drain-timeout-s", "20", replicas=3,
    ) as cluster:  # fmt: skip
        _, victim_pid = cluster.replicas[VICTIM]
        victim = cluster.address(VICTIM)
        state: dict[str, int | None] = {"terminated_at": None}

        def on_progress(run: LoadRun) -> None:
            if state["terminated_at"] is None and len(run.outcomes) >= LOAD_REQUESTS // 5:
                os.kill(victim_pid, signal.SIGTERM)
                state["terminated_at"] = len(run.outcomes)

        # Several inputs per request, so the victim holds admitted work when the signal lands.
        run = asyncio.run(
            load_run(cluster.url, requests=LOAD_REQUESTS, clients=LOAD_CLIENTS,
                     prefix="drain", inputs_per_request=4, on_progress=on_progress)
        )  # fmt: skip
        entries = access_log(cluster.access_log_path, "drain", expect=LOAD_REQUESTS)
        deadline = time.monotonic() + 30
        while pid_exists(victim_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        launcher_log = cluster.errors()

    assert state["terminated_at"] is not None
    assert run.failures == [], run.failures[:5]
    assert len(entries) == LOAD_REQUESTS
    # The victim drained and exited cleanly (the launcher reports its exit status).
    assert re.search(rf"{VICTIM} exited with 0\b", launcher_log), launcher_log[-2000:]
    # Whatever the victim refused while draining (503) was retried on another replica.
    refused = [e for e in entries.values() if e["upstream_status"].startswith("503")]
    assert all(e["status"] == 200 and served_by(e) != victim for e in refused)
    share = shares(entries)
    figures = {name: share[cluster.address(name)] for name in cluster.replicas}
    print(f"\ndraining: {LOAD_REQUESTS} requests, {LOAD_CLIENTS} clients, "
          f"{len(run.failures)} failures; {VICTIM} got SIGTERM after {state['terminated_at']} "
          f"answers and exited 0; {len(refused)} requests it refused with 503 while draining "
          f"were retried elsewhere; per-replica share {figures}")  # fmt: skip
