"""Forward passes side by side on a CPU (``bulk.lanes``): every batch once, outputs in input
order, the first error stops every lane, and lanes only where memory cannot bind them."""

import math
import threading
import time

import numpy as np
import pytest
import torch

from batching import MemoryLimit
from bulk.lanes import MAX_LANES, Lanes, lane_shape
from bulk.runner import WARM_UP_MEMORY_SHARE
from tests.bulk_fakes import FakeEmbedder, expected_embedding
from tests.test_bulk_runner import TEXTS, Probe, largest_capped_peak, runner_for


@pytest.fixture(autouse=True)
def torch_threads():
    """Lanes set torch's thread count; every test leaves it as it found it."""
    before = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == before
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("threads", "shape"), [(1, (1, 1)), (2, (2, 1)), (3, (3, 1)), (16, (MAX_LANES, 4))]
)
def test_the_lanes_and_their_threads_from_the_cpus_allowed(threads, shape):
    assert lane_shape(threads) == shape


def test_every_task_runs_once_on_both_lanes():
    lanes = Lanes(2, 1)
    seen: list[tuple[int, str]] = []

    def run_one(task):
        time.sleep(0.005)  # long enough that both lanes take tasks
        seen.append((task, threading.current_thread().name))

    try:
        lanes.run(list(range(40)), run_one)
        assert sorted(task for task, _ in seen) == list(range(40))
        assert {name for _, name in seen} == {threading.current_thread().name, "batchfit-lane-1"}
        assert torch.get_num_threads() == 1
    finally:
        lanes.close()
    assert not any(thread.is_alive() for thread in lanes._threads)


def test_the_first_error_stops_every_lane_and_is_raised_once_the_passes_end():
    lanes = Lanes(2, 1)
    ran: list[int] = []

    def run_one(task):
        if task == 5:
            raise RuntimeError("pass failed")
        time.sleep(0.005)
        ran.append(task)

    try:
        with pytest.raises(RuntimeError, match="pass failed"):
            lanes.run(list(range(100)), run_one)
        assert len(ran) < 20  # no lane took more tasks once one failed
        lanes.run([1, 2], run_one)  # the lanes serve the next run
        assert ran[-2:] in ([1, 2], [2, 1])
    finally:
        lanes.close()


def test_side_by_side_passes_give_every_output_in_input_order():
    model = FakeEmbedder()
    threads, forward = set(), model.forward

    def timed_forward(items):
        threads.add(threading.current_thread().name)
        time.sleep(0.01)  # a pass takes time: long enough that both lanes take batches
        return forward(items)

    model.forward = timed_forward
    runner = runner_for(model, Probe(), max_items=2)  # small batches: many to share
    assert runner.use_lanes(2) == "2 passes at a time, 1 torch thread each"
    try:
        items = model.prepare(TEXTS, truncate=True)
        outputs = runner.run(items)
    finally:
        runner.close()
    assert all(
        np.array_equal(o, expected_embedding(t)) for o, t in zip(outputs, TEXTS, strict=True)
    )
    assert threads == {threading.current_thread().name, "batchfit-lane-1"}
    assert sorted(t for batch in model.batches for t in batch) == sorted(TEXTS)  # each once
    assert runner.stats.inputs == len(TEXTS) and runner.stats.batches == len(model.batches) > 2


def test_no_lanes_where_memory_could_bind_two_batches_at_once_or_one_thread_is_allowed():
    model = FakeEmbedder(max_input_tokens=512)
    probe = Probe(free_bytes=0, limit=MemoryLimit("cgroup", 2**40, "/x"))
    runner = runner_for(model, probe)
    peak = largest_capped_peak(runner)
    probe.free_bytes = math.ceil(1.5 * peak / WARM_UP_MEMORY_SHARE)  # one fits, two do not
    assert runner.use_lanes(2) is None and runner.lanes is None
    probe.free_bytes = math.ceil(2 * peak / WARM_UP_MEMORY_SHARE)
    assert runner.use_lanes(1) is None
    assert runner.use_lanes(2) is not None
    runner.close()
