"""``python -m bench.saturation``'s arithmetic: roles of threads, the host's CPU, the line."""

import os
import sys

from batching.measure import forward_from_baseline
from bench.saturation import (
    IN_FORWARD,
    CpuShare,
    SaturationRun,
    _role,
    describe,
    host_cpu_seconds,
    in_forward,
)
from bench.stages import Frame


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


def test_a_model_thread_sample_is_inside_a_forward_pass_only_below_the_call_of_it():
    outer = (Frame("ModelThread._work", "batching/model_thread.py"),
             Frame("MemoryWatch.forward", "batching/readings.py"),
             Frame(IN_FORWARD, "batching/measure.py"))  # fmt: skip
    assert in_forward((*outer, Frame("TextModel.forward", "models/text.py")))
    assert not in_forward((*outer, Frame("HostProbe.start_batch", "batching/probes.py")))
    assert not in_forward(outer)  # the line that calls it, before the call
    assert not in_forward(outer[:1])  # waiting for work


def test_the_function_named_is_the_one_that_calls_the_model_s_forward_pass():
    called_from = []

    def forward(items):
        called_from.append(sys._getframe(1).f_code.co_name)
        return list(items)

    forward_from_baseline(forward, [1, 2], probe=None)
    assert called_from == [IN_FORWARD]
