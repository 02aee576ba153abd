"""CPU thread count of the model (the flag, else OMP_NUM_THREADS, else every CPU the cgroup's
quota allows), of the benchmark's in-process limit (torch's default, whatever the server's),
and OpenMP's wait policy."""

import os
import subprocess
import sys
import threading

import pytest
import torch

import models.loading
from batching.procfs import CpuQuota
from bench.plain import load_plain_encoder
from bench.runner import SERVER_CONFIGS, BenchOptions
from models import ModelSpec, available_cpus, load_model
from models.spec import cpu_threads, omp_num_threads
from models.testing import save_tiny_model
from server.runtime import startup as startup_module
from server.runtime import threads
from server.runtime.runtime import Runtime
from server.runtime.threads import (
    AFFINITY,
    FLAG,
    OMP,
    ThreadCount,
    choose_threads,
    thread_count,
)
from server.runtime.threads import QUOTA as QUOTA_SOURCE
from server.settings import Settings
from tests.ci import unavailable
from tests.servers import ROOT


def test_default_uses_every_cpu_the_process_may_use(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads(None) == available_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("requested", [1, 3])
def test_explicit_count_wins(requested):
    assert cpu_threads(requested, {"OMP_NUM_THREADS": "2"}) == requested


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", 1), ("4", 4), (" 3 ", 3), ("4,2", 4), ("", None), ("0", None), ("-2", None),
     ("many", None)],
)  # fmt: skip
def test_a_set_omp_num_threads_wins_over_every_cpu(value, expected):
    assert omp_num_threads({"OMP_NUM_THREADS": value}) == expected
    assert cpu_threads(None, {"OMP_NUM_THREADS": value}) == (expected or available_cpus())


QUOTA = CpuQuota(1.5, "/kubepods/pod1")


@pytest.mark.parametrize(
    ("requested", "omp", "affinity", "quota", "expected"),
    [
        (None, None, 64, CpuQuota(4.0, "/pod"), ThreadCount(4, QUOTA_SOURCE, "/pod")),
        (None, None, 64, QUOTA, ThreadCount(2, QUOTA_SOURCE, "/kubepods/pod1")),  # rounded up
        (None, None, 8, CpuQuota(0.2, "/tiny"), ThreadCount(1, QUOTA_SOURCE, "/tiny")),
        (None, None, 2, CpuQuota(4.0, "/pod"), ThreadCount(2, AFFINITY)),  # quota above it
        (None, None, 2, CpuQuota(2.0, "/pod"), ThreadCount(2, AFFINITY)),
        (None, None, 2, None, ThreadCount(2, AFFINITY)),
        (None, 1, 64, QUOTA, ThreadCount(1, OMP)),
        (3, 1, 64, QUOTA, ThreadCount(3, FLAG)),
    ],
)  # fmt: skip
def test_the_default_is_the_smaller_of_affinity_and_quota(requested, omp, affinity, quota,
                                                          expected):  # fmt: skip
    assert choose_threads(requested, omp, affinity, quota) == expected


def test_the_start_up_log_says_where_the_count_came_from():
    assert ThreadCount(4, QUOTA_SOURCE, "/pod").describe() == "threads: 4 (cgroup cpu quota /pod)"
    assert ThreadCount(1, OMP).describe() == "threads: 1 (OMP_NUM_THREADS)"
    assert ThreadCount(2, AFFINITY).describe() == "threads: 2 (CPU affinity)"


async def test_the_runtime_loads_every_model_with_its_count_and_logs_it(
    tmp_path, registry, monkeypatch, caplog
):
    folder = save_tiny_model(tmp_path / "m")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(threads, "own_cpu_quota", lambda: CpuQuota(1.0, "/q"))
    loaded = []
    real = startup_module.load_model
    monkeypatch.setattr(startup_module, "load_model",
                        lambda spec: loaded.append(spec.num_threads) or real(spec))  # fmt: skip
    settings = Settings(model=(f"a={folder}", f"b={folder}"), device="cpu")
    runtime = Runtime(settings, registry=registry)
    with caplog.at_level("INFO", logger="batchfit"):
        await runtime.start()
    try:
        assert runtime.startup_error is None
        assert loaded == [1, 1]
        assert "threads: 1 (OMP_NUM_THREADS)" in caplog.text
    finally:
        await runtime.stop()
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "available_cpus", lambda: 8)
    assert thread_count(None) == ThreadCount(1, QUOTA_SOURCE, "/q")
    assert thread_count(5) == ThreadCount(5, FLAG)


def on_a_thread(fn):
    """Run ``fn`` on its own thread, as the server loads models (torch's count is per thread)."""
    seen = []
    before = torch.get_num_threads()
    thread = threading.Thread(target=lambda: seen.append(fn()))
    thread.start()
    thread.join(120)
    torch.set_num_threads(before)
    return seen[0]


def test_load_model_sets_the_threads_of_the_loading_thread(tmp_path):
    folder = save_tiny_model(tmp_path / "m")

    def load():
        load_model(ModelSpec(model=str(folder), device="cpu", num_threads=1))
        first = torch.get_num_threads()
        torch.set_num_threads(3)
        load_model(ModelSpec(model=str(folder), device="cpu"))
        return [first, torch.get_num_threads()]

    assert on_a_thread(load) == [1, cpu_threads(None)]


def test_the_limit_uses_torchs_default_thread_count_whatever_the_servers(tmp_path, monkeypatch):
    folder = save_tiny_model(tmp_path / "m")
    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True, text=True, timeout=120, check=True,
        env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
    )  # fmt: skip
    torch_default = int(fresh.stdout)
    # Were the server's default one thread, the limit would still use torch's own.
    monkeypatch.setattr(models.loading, "cpu_threads", lambda requested: requested or 1)

    def load():
        load_plain_encoder(str(folder))
        return torch.get_num_threads()

    assert on_a_thread(load) == torch_default


def test_every_bench_configuration_runs_the_servers_thread_count():
    assert {"off", "fixed-8", "fixed-64", "fixed-128", "adaptive"} <= set(SERVER_CONFIGS)
    assert not any("--num-threads" in flags for flags in SERVER_CONFIGS.values())
    assert SERVER_CONFIGS["adaptive"] == ()


def test_the_limit_budget_is_the_servers_default_caps():
    options, fields = BenchOptions(), Settings.model_fields
    assert options.max_batch_size == fields["max_batch_size"].default
    assert options.max_batch_tokens == fields["max_batch_tokens"].default


SPIN_PROBE = """
import time, torch
torch.set_num_threads(2)
a = torch.randn(256, 256)
spun = []
for _ in range(7):
    for _ in range(20):
        a @ a
    started = time.process_time()
    time.sleep(0.05)
    spun.append(time.process_time() - started)
print(min(spun) * 1e3)
"""
# NOTE: the least of seven: libgomp's default spins after every parallel region, so each
# sample would show it, while another process's load only ever adds CPU time to a sample
# (a worker descheduled mid-matmul finishes its share during the sleep).


def test_the_server_bounds_openmp_spinning_before_torch_loads():
    """CPU burnt in 50 ms of sleep after parallel work: libgomp's default spins ~9 ms, the
    server's 30,000 rounds about 1 ms."""
    if available_cpus() < 2:
        unavailable("OpenMP's idle workers need 2 CPUs to spin; this process may use one")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    probe = subprocess.run(
        [sys.executable, "-c", "import server\n" + SPIN_PROBE],
        capture_output=True, text=True, timeout=120, check=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert float(probe.stdout) < 4.0, f"idle OpenMP workers spun {probe.stdout.strip()} ms"


@pytest.mark.parametrize("num_threads", [None, 2])
async def test_the_runtime_guards_a_thread_count_it_chose_and_keeps_an_operators(
    tmp_path, registry, monkeypatch, num_threads
):
    folder = save_tiny_model(tmp_path / "m")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    monkeypatch.setattr(threads, "own_cpu_quota", lambda: None)
    settings = Settings(model=(f"a={folder}",), device="cpu", num_threads=num_threads)
    runtime = Runtime(settings, registry=registry)
    await runtime.start()
    try:
        assert runtime.startup_error is None
        assert registry.get_sample_value("batchfit_model_threads") == 2
        forward = runtime.batcher.lanes["a"].forward
        if num_threads is None:  # the count is the server's: every pass goes through a guard
            assert runtime.thread_guard is not None and runtime.thread_guard.num_threads == 2
            assert forward.__qualname__ == "ThreadGuard.wrap.<locals>.guarded_forward"
        else:
            assert runtime.thread_guard is None
            assert "guarded" not in forward.__qualname__
    finally:
        await runtime.stop()
