"""The cores a replica's torch really computes with, counted by the kernel: shared out among
the replicas of ``batchfit up``, and no more than a real cgroup CPU quota allows."""

from __future__ import annotations

import httpx
import pytest

from models.spec import available_cpus
from server.runtime.threads import host_capacity
from tests.busy_threads import busy_threads
from tests.cgroups import child_cgroup
from tests.ci import unavailable
from tests.launch import run_launcher
from tests.servers import run_server

pytestmark = pytest.mark.integration

LONG = " ".join(["memory", "batch", "split", "token", "model"] * 60)  # truncated to 256 tokens
MIN_BUSY_S = 0.3
"""The busiest thread's CPU time over the burst: enough ticks for the shares to mean something."""


def burst(url: str) -> None:
    with httpx.Client(base_url=url, timeout=300) as client:
        for burst in range(3):  # distinct inputs: none is a cache hit
            inputs = [f"{burst} {i} {LONG}" for i in range(16)]
            client.post("/v1/infer", json={"inputs": inputs}).raise_for_status()


def test_each_replica_of_up_computes_on_its_share_of_the_cores(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = host_capacity().num_threads
    if cores < 2:
        unavailable(f"sharing cores among 2 replicas needs 2 CPUs; this process may use {cores}")
    share = cores // 2
    with run_launcher(tmp_path, replicas=2) as cluster:
        for name, (url, pid) in cluster.replicas.items():
            busy, busiest_s = busy_threads(pid, lambda url=url: burst(url))
            assert busiest_s >= MIN_BUSY_S, busiest_s
            assert busy == share, (name, busy, share)
            log = (cluster.workdir / f"{name}.log").read_text()
            assert f"threads: {share} (OMP_NUM_THREADS)" in log


def test_a_replica_under_a_cgroup_cpu_quota_computes_on_that_many_cores(tmp_path, monkeypatch):
    """The quota sits on the replica's parent cgroup, not its own: the walk goes up."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = available_cpus()
    if cpus < 2:
        unavailable(f"a quota below the affinity needs 2 CPUs; this process may use {cpus}")
    quota = cpus - 1
    with (
        child_cgroup("cpu-quota", "cpu") as parent,
        child_cgroup("replica", "cpu", parent) as own,
    ):
        parent.set_cpu_quota(quota)
        with run_server(tmp_path, preexec=own.join) as server:
            busy, busiest_s = busy_threads(server.process.pid, lambda: burst(server.url))
            log = server.log()
    assert f"threads: {quota} (cgroup cpu quota {parent.path})" in log
    assert busiest_s >= MIN_BUSY_S, busiest_s
    assert busy == quota, (busy, quota)
