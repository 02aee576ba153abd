"""CPU thread count of the model (every CPU by default), of the benchmark's in-process limit
(torch's default, whatever the server's), and OpenMP's wait policy."""

import os
import subprocess
import sys
import threading

import pytest
import torch

import models.loading
from bench.limit import load_bench_model
from bench.runner import SERVER_CONFIGS, BenchOptions
from models import ModelSpec, available_cpus, load_model
from models.loading import cpu_threads
from models.testing import save_tiny_model
from server.settings import Settings
from tests.servers import ROOT


def test_default_uses_every_cpu_the_process_may_use():
    assert cpu_threads(None) == available_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("requested", [1, 3])
def test_explicit_count_wins(requested):
    assert cpu_threads(requested) == requested


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
        load_bench_model(str(folder))
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


@pytest.mark.skipif(available_cpus() < 2, reason="OpenMP's idle workers need 2 CPUs to spin")
def test_the_server_bounds_openmp_spinning_before_torch_loads():
    """CPU burnt in 50 ms of sleep after parallel work: libgomp's default spins ~9 ms."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    probe = subprocess.run(
        [sys.executable, "-c", "import server\n" + SPIN_PROBE],
        capture_output=True, text=True, timeout=120, check=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert float(probe.stdout) < 2.0, f"idle OpenMP workers spun {probe.stdout.strip()} ms"
