"""Failover with real Nginx: a replica dies (SIGKILL) in the middle of a load run."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.launch import pid_exists, run_launcher, start_launcher, stop, wait_for_output, wait_up
from tests.loadrun import LoadRun, access_log, load_run, served_by, shares

pytestmark = pytest.mark.integration

LOAD_REQUESTS = 400
LOAD_CLIENTS = 6
VICTIM = "replica-1"
# Unanswered this long after the freeze: stuck on the frozen replica (answers here take tens of
# ms). Short enough that most of the load is still to come when it dies: the survivors answer
# about 200 requests a second on a quiet 2-CPU host, so it dies after about 150 of the 400.
STUCK_S = 0.5


def test_sigkill_mid_run_no_client_sees_a_failure(tmp_path):
    with run_launcher(
        tmp_path, "--max-batch-size", "8", "--rate-limit-rps", "1000",
        "--rate-limit-burst", "1000", "--no-restart", replicas=3,
    ) as cluster:  # fmt: skip
        _, victim_pid = cluster.replicas[VICTIM]
        victim = cluster.address(VICTIM)
        state = {"stopped_at": None, "killed_at": None}

        def watch(run: LoadRun) -> None:
            done = len(run.outcomes)
            if state["stopped_at"] is None and done >= LOAD_REQUESTS // 10:
                # Freeze the victim first, so that requests are certainly in flight on it
                # (sent, unanswered) when it dies; least_conn keeps sending it some.
                os.kill(victim_pid, signal.SIGSTOP)
                state["stopped_at"] = done
            elif (state["stopped_at"] is not None and state["killed_at"] is None
                  and run.oldest_in_flight_s() >= STUCK_S):  # fmt: skip
                os.kill(victim_pid, signal.SIGKILL)
                state["killed_at"] = done

        async def load_and_watch() -> LoadRun:
            # Watched on a clock, not only as answers come: once the other clients are done, or
            # were every client's request stuck on the frozen replica, no answer would come
            # until the clients' own timeout.
            run = LoadRun()
            load = asyncio.create_task(
                load_run(cluster.url, requests=LOAD_REQUESTS, clients=LOAD_CLIENTS,
                         prefix="failover", run=run)
            )  # fmt: skip
            while not load.done():
                watch(run)
                await asyncio.wait({load}, timeout=0.05)
            return load.result()

        run = asyncio.run(load_and_watch())
        assert state["killed_at"] is not None, "no request was ever stuck on the frozen replica"
        assert cluster.process.poll() is None  # the launcher keeps running without it
        # Nginx writes a request's line only after it has answered it: wait for all of them.
        entries = access_log(cluster.access_log_path, "failover", expect=LOAD_REQUESTS)
        models = httpx.get(f"{cluster.url}/v1/models", timeout=10)
        error_log = cluster.workdir.joinpath("logs", "error.log").read_text()
        # The launcher notices the death at its next look (every 0.2 s, later on a busy host),
        # which can come after the last answer: wait for it before stopping the launcher.
        died = rf"{VICTIM} \(pid {victim_pid}\) exited with -9 \(killed by SIGKILL"
        wait_for_output(cluster, died, timeout_s=10, errors=True)

    # A replica killed between a response's head and its body would cut that client off: Nginx
    # had the head and retries no more (test_nginx.py, ..._dies_after_its_head_...). Replicas
    # send head and body in one write (server/one_write.py), so it has the whole or nothing.
    assert "while reading upstream" not in error_log, error_log
    assert run.failures == [], (run.failures[:5], state, error_log[-3000:])
    assert len(entries) == LOAD_REQUESTS
    assert models.status_code == 200  # still serving after the run
    # Requests that were sent to the victim and cut off mid-flight were retried elsewhere
    # (non_idempotent) and succeeded.
    mid_flight = [
        e for e in entries.values()
        if e["upstream_addr"].startswith(victim + ", ")
        and int(e["upstream_bytes_sent"].split(", ")[0] or 0) > 0
    ]  # fmt: skip
    assert mid_flight, "no request was cut off mid-flight on the killed replica"
    assert all(e["status"] == 200 for e in mid_flight)
    retried = [e for e in entries.values() if "," in e["upstream_addr"]]
    share = shares(entries)
    figures = {name: share[cluster.address(name)] for name in cluster.replicas}
    survivors = [name for name in cluster.replicas if name != VICTIM]
    print(f"\nfailover: {LOAD_REQUESTS} requests, {LOAD_CLIENTS} clients, "
          f"{len(run.failures)} failures, {VICTIM} frozen after {state['stopped_at']} and "
          f"SIGKILLed after {state['killed_at']} answers; {len(mid_flight)} cut off mid-flight "
          f"and {len(retried)} retried in all; per-replica share {figures}")  # fmt: skip
    assert all(served_by(e) != victim for e in mid_flight)
    # Request numbers are taken in start order: at the kill at most killed_at + clients had
    # started, so every later one started after the victim was dead. Survivors took them all.
    after_kill = [e for rid, e in entries.items()
                  if int(rid.rsplit("-", 1)[1]) >= state["killed_at"] + LOAD_CLIENTS]  # fmt: skip
    assert after_kill
    assert all(served_by(e) != victim for e in after_kill)
    print(f"failover: {len(after_kill)} requests started after the kill, all served by "
          f"{survivors}")  # fmt: skip
    for name in survivors:
        assert figures[name] > figures[VICTIM]
    assert re.search(died, cluster.errors())
    assert "not restarted (--no-restart)" in cluster.errors()


def test_a_killed_replica_is_restarted_while_nginx_serves_from_the_other(tmp_path):
    with run_launcher(tmp_path, "--max-batch-size", "4", "--restart-backoff-s", "0.5",
                      replicas=2) as cluster:  # fmt: skip
        _, victim_pid = cluster.replicas[VICTIM]
        os.kill(victim_pid, signal.SIGKILL)
        # While it is dead, waiting and loading again, every request is answered.
        run = asyncio.run(load_run(cluster.url, requests=40, clients=2, prefix="restart"))
        match = wait_for_output(cluster, rf"^{VICTIM}: ready again \(pid (\d+), restart 1\)",
                                timeout_s=120)  # fmt: skip
        new_pid = int(match.group(1))
        ready = httpx.get(f"{cluster.replicas[VICTIM][0]}/health/ready", timeout=10)
        entries = access_log(cluster.access_log_path, "restart")
    assert run.failures == [], run.failures[:5]
    assert len(entries) == 40 and all(e["status"] == 200 for e in entries.values())
    assert new_pid != victim_pid and ready.status_code == 200
    errors = cluster.errors()
    assert re.search(rf"{VICTIM} \(pid {victim_pid}\) exited with -9 \(killed by SIGKILL\b",
                     errors)  # fmt: skip
    assert "restarting it in 0.5s" in errors
    # The stop report names every process, its exit code and where the logs are.
    output = cluster.output()
    assert re.search(rf"stopped {VICTIM} \(pid {new_pid}, exit code 0, restarted 1x\)", output)
    assert re.search(r"stopped replica-0 \(pid \d+, exit code 0\)", output)
    assert re.search(r"stopped nginx \(pid \d+, exit code 0\)", output)
    assert f"logs kept in {cluster.workdir.resolve()}" in output


def test_a_hung_replica_is_killed_and_restarted_and_its_requests_answered(tmp_path):
    # Frozen (SIGSTOP): alive, its port still accepting connections, nothing answered. Nginx
    # never retries on a timeout, so the requests it holds wait until the launcher kills it.
    with run_launcher(
        tmp_path, "--max-batch-size", "4", "--restart-backoff-s", "0.5",
        "--liveness-period-s", "0.5", "--liveness-timeout-s", "1", "--liveness-failures", "2",
        replicas=2,
    ) as cluster:  # fmt: skip
        _, victim_pid = cluster.replicas[VICTIM]
        victim = cluster.address(VICTIM)
        os.kill(victim_pid, signal.SIGSTOP)
        started = time.monotonic()
        run = asyncio.run(load_run(cluster.url, requests=40, clients=4, prefix="hung"))
        took_s = time.monotonic() - started
        match = wait_for_output(cluster, rf"^{VICTIM}: ready again \(pid (\d+), restart 1\)",
                                timeout_s=120)  # fmt: skip
        new_pid = int(match.group(1))
        ready = httpx.get(f"{cluster.replicas[VICTIM][0]}/health/ready", timeout=10)
        entries = access_log(cluster.access_log_path, "hung", expect=40)
    assert run.failures == [], run.failures[:5]
    assert len(entries) == 40 and all(e["status"] == 200 for e in entries.values())
    # Some requests went to the frozen replica and were answered by the other once it died.
    held = [e for e in entries.values() if e["upstream_addr"].startswith(victim + ", ")]
    assert held and all(served_by(e) != victim for e in held), held
    assert took_s < 30, took_s  # two questions unanswered, not the clients' 60 s timeout
    assert new_pid != victim_pid and ready.status_code == 200
    errors = cluster.errors()
    pid = rf"{VICTIM} \(pid {victim_pid}\)"
    assert re.search(rf"{pid}: /health/live did not answer within 1s \(1 in a row; killed at 2\)",
                     errors)  # fmt: skip
    assert re.search(rf"{pid} is alive but does not answer /health/live; killing it", errors)
    assert re.search(rf"{pid} exited with -9 \(killed by SIGKILL\b", errors)
    print(f"\nhung replica: {len(held)} requests held by it, answered by the other after the "
          f"kill; the run took {took_s:.1f}s")  # fmt: skip


def test_replicas_with_api_processes_serve_scrape_and_stop(tmp_path):
    # Each replica is an engine with two API processes; the launcher gives it --metrics-port,
    # which the engine serves, every process's series merged.
    def infer_requests(metrics_url: str) -> float:
        scrape = httpx.get(metrics_url, timeout=30).text
        labels = 'code="200",endpoint="/v1/infer",error_type=""'
        match = re.search(rf"^batchfit_requests_total{{{labels}}} (\S+)$", scrape, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    with run_launcher(tmp_path, "--model", "python:bench.noop:create", "--api-workers", "2",
                      replicas=2) as cluster:  # fmt: skip
        engines = [pid for _, pid in cluster.replicas.values()]
        api_processes = [
            int(child) for pid in engines
            for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        ]  # fmt: skip
        for i in range(8):
            answer = httpx.post(f"{cluster.url}/v1/infer", json={"inputs": f"w {i}"}, timeout=30)
            assert answer.status_code == 200, answer.text
        answered = sum(infer_requests(url) for url in cluster.metrics_urls.values())
    assert len(api_processes) == 4 and answered == 8
    assert "exited with" not in cluster.errors()  # nothing died or was restarted
    assert not [pid for pid in engines + api_processes if pid_exists(pid)]


def test_ctrl_c_stops_every_process(tmp_path):
    launch = start_launcher(tmp_path, "--max-batch-size", "4", replicas=1)
    try:
        wait_up(launch)
        children = launch.child_pids()
        assert all(pid_exists(pid) for pid in children)
        assert httpx.post(f"{launch.url}/v1/infer", json={"inputs": "hi"}, timeout=30).is_success
    finally:
        code = stop(launch, signal.SIGINT)
    assert code == 0
    assert "batchfit up: stopping" in launch.output()
    assert not [pid for pid in children if pid_exists(pid)]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{launch.url}/v1/models", timeout=5)
    assert not launch.workdir.joinpath("nginx.pid").exists()


def test_a_replica_that_cannot_start_fails_the_launch(tmp_path):
    launch = start_launcher(tmp_path, "--device", "cuda:99", replicas=2)
    try:
        code = launch.process.wait(240)
    finally:
        stop(launch)
    assert code == 1
    assert "exited with 1" in launch.errors()
    pids = [int(p) for p in re.findall(r" pid (\d+) ", launch.output())]
    assert len(pids) == 2
    assert not [pid for pid in pids if pid_exists(pid)]
