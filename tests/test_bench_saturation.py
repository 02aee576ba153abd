"""``python -m bench.saturation``'s arithmetic: roles of threads, the host's CPU, the line."""

import os

from bench.saturation import CpuShare, SaturationRun, _role, describe, host_cpu_seconds


def test_threads_get_their_role_by_the_name_python_gives_them():
    assert _role("batchfit-model_0") == "model thread"
    assert _role("batchfit-tokenize_0") == "tokenizer"
    assert _role("MainThread") == "event loop"
    assert _role("batchfit-probe") == "other threads"


def test_the_host_s_busy_cpu_time_grows_with_work_and_counts_every_cpu():
    before, cpus = host_cpu_seconds()
    sum(i * i for i in range(2_000_000))
    after, _ = host_cpu_seconds()
    assert cpus == os.cpu_count() and after > before


def test_the_line_splits_the_host_between_server_client_rest_and_idle():
    cpus = CpuShare({"model thread": 0.8, "OpenMP workers": 0.7, "event loop": 0.1},
                    client=0.2, host_busy=1.9, host_cpus=2)  # fmt: skip
    run = SaturationRun("aiohttp", 128, 120.0, 0, cpus, in_forward=0.98)
    line = describe(run)
    assert "the server 1.60 (model thread 0.80, OpenMP workers 0.70, event loop 0.10)" in line
    assert "the load generator 0.20; the rest of the host (py-spy included) 0.10" in line
    assert "idle 0.10" in line and "inside a forward pass 98% of the time" in line
