"""Forward passes side by side on a CPU, each on its own thread and its own share of the cores.

On a CPU, one forward pass on every core loses to the same cores split between passes that
run at once: a pass on one thread needs no barrier between its threads after each operator,
and the small matrices of a small model spread badly over many. Measured with the bundled
model on 2 cores, sorted batches of 16 of a mixed corpus (``python -m bench.lanes``): 201 and
245 inputs/s for one pass at a time on 2 threads, 264 and 282 for two at a time on 1 thread
each.

A lane is one thread that runs every pass handed to it for the whole job (the calling thread
is the first lane): torch loses 30-40% when its passes hop between threads. Lanes are used
only where memory cannot bind any batch (``Runner.use_lanes``), so that two batches in
flight at once never need more than the budget.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")

MAX_LANES = 4
"""The most passes at once: each holds the GIL for its Python between operators, so past a
few the lanes wait on each other."""


def lane_shape(num_threads: int) -> tuple[int, int]:
    """(lanes, torch threads per lane) for a CPU job allowed ``num_threads`` threads."""
    lanes = max(1, min(MAX_LANES, num_threads))
    return lanes, max(1, num_threads // lanes)


class Lanes:
    """``num_lanes`` threads that run passes, the calling thread one of them; each sets
    torch's thread count to ``threads_per_lane`` before its first pass."""

    def __init__(self, num_lanes: int, threads_per_lane: int) -> None:
        self.num_lanes = num_lanes
        self.threads_per_lane = threads_per_lane
        self._work: list[queue.SimpleQueue[Callable[[], None] | None]] = []
        self._threads: list[threading.Thread] = []
        for number in range(1, num_lanes):
            work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._serve, args=(work,), name=f"batchfit-lane-{number}", daemon=True
            )
            self._work.append(work)
            self._threads.append(thread)
            thread.start()
        self._threads_before = torch_threads()  # the calling thread's, restored by ``close``
        _set_threads(threads_per_lane)

    def run(self, tasks: Sequence[T], run_one: Callable[[T], None]) -> None:
        """``run_one(task)`` for every task, each once, the lanes taking the next task as they
        finish one (in order). The first error stops every lane from taking another, and is
        raised here once the passes running have ended."""
        pending: Iterator[T] = iter(tasks)
        lock = threading.Lock()
        errors: list[BaseException] = []

        def take() -> tuple[bool, T | None]:
            with lock:
                if errors:
                    return False, None
                for task in pending:
                    return True, task
                return False, None

        def drain() -> None:
            try:
                while True:
                    found, task = take()
                    if not found:
                        return
                    run_one(task)  # type: ignore[arg-type]
            except BaseException as error:  # every lane's error ends the run
                with lock:
                    errors.append(error)

        done = [threading.Event() for _ in self._work]
        for work, finished in zip(self._work, done, strict=True):
            work.put(lambda finished=finished: _then(drain, finished.set))
        try:
            drain()
        finally:
            for finished in done:
                while not finished.wait(0.1):  # a running pass ends; Ctrl-C still lands
                    pass
        if errors:
            raise errors[0]

    def close(self) -> None:
        """End the lane threads (each after its pass, if one runs; a thread left running
        at exit aborts the process in torch's C++), and give the calling thread its thread
        count back."""
        for work in self._work:
            work.put(None)
        for thread in self._threads:
            thread.join()
        _set_threads(self._threads_before)

    def _serve(self, work: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        _set_threads(self.threads_per_lane)
        while (job := work.get()) is not None:
            job()


def _then(first: Callable[[], None], after: Callable[[], None]) -> None:
    try:
        first()
    finally:
        after()


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _set_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)
