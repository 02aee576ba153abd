"""Passes side by side (``batching/side.py``): a scripted model whose passes the test holds,
two model threads, a scripted probe and a sizer whose predicted peak is 1 KiB per token."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from batching import (
    AdaptiveConfig,
    AdaptiveSizer,
    BatchBudget,
    Batcher,
    BatcherConfig,
    BatchingMetrics,
    InferenceFailed,
    Lane,
    ModelThread,
    MonotonicClock,
    PeakModel,
    Pending,
    RequestQueue,
    ShuttingDown,
    room_for_passes,
)
from models import DeviceError, Item, ModelOutOfMemory
from tests.fakes import ScriptedProbe

TIMEOUT = 10  # guard against hangs only
KIB = 1024


class HeldModel:
    """Records every pass (``alone`` through ``forward``, ``beside`` through the side
    forward) and how many passes ran at once; every pass waits for ``gate``."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self._lock = threading.Lock()
        self.running = 0
        self.most_at_once = 0
        self.passes: list[tuple[str, list[str], int]] = []
        """(kind, texts, passes already running when it started)."""
        self.fail_on: str | None = None

    def forward_as(self, kind: str):
        def forward(items: Sequence[Item]) -> list[Any]:
            texts = [str(item.data) for item in items]
            with self._lock:
                self.passes.append((kind, texts, self.running))
                self.running += 1
                self.most_at_once = max(self.most_at_once, self.running)
            try:
                self.gate.wait(timeout=30)
                if self.fail_on in texts:
                    raise DeviceError("the scripted device failed")
                return [f"{kind}:{text}" for text in texts]
            finally:
                with self._lock:
                    self.running -= 1

        return forward


class Pair:
    """A batcher that runs passes side by side on two threads."""

    def __init__(self, *, free_bytes: int = 2**30, max_items: int = 4) -> None:
        self.model = HeldModel()
        self.queue = RequestQueue(1024)
        self.registry = CollectorRegistry()
        self.threads = [ModelThread("test-main"), ModelThread("test-side")]
        sizer = AdaptiveSizer(
            PeakModel(alpha=KIB, beta=0),
            AdaptiveConfig(
                max_items=max_items, max_tokens=10_000, headroom_fraction=0, safety_factor=1.0
            ),
        )
        self.batcher = Batcher(
            queue=self.queue,
            lanes=[
                Lane(
                    "m",
                    self.model.forward_as("alone"),
                    sizer,
                    side_forward=self.model.forward_as("beside"),
                )
            ],
            model_thread=self.threads[0],
            clock=MonotonicClock(),
            metrics=BatchingMetrics(self.registry, max_batch_size=32, max_batch_tokens=10_000),
            config=BatcherConfig(max_wait_s=0),
            oom_errors=(ModelOutOfMemory,),
            fatal_errors=(DeviceError,),
            probe=ScriptedProbe(free_bytes),
        )
        self.batcher.run_side_by_side(self.threads[1:])
        self.task: asyncio.Task[None] | None = None

    def submit(self, texts: Sequence[str]) -> list[Pending]:
        loop = asyncio.get_running_loop()
        now = loop.time()
        pendings = [
            Pending(
                item=Item(data=text, cost=len(text.split()) + 2),
                future=loop.create_future(),
                arrival_s=now,
                deadline_s=now + 60,
                priority=0,
                request_id="r",
                index=i,
                model="m",
            )
            for i, text in enumerate(texts)
        ]
        self.queue.put_many(pendings)
        return pendings

    def start(self) -> None:
        self.task = asyncio.create_task(self.batcher.run())

    async def until(self, condition) -> None:
        """Wait for something to happen (the passes run on other threads)."""
        async with asyncio.timeout(TIMEOUT):
            while not condition():
                await asyncio.sleep(0.005)

    @staticmethod
    async def loop_turns(turns: int = 20) -> None:
        """Let the event loop run this many times: the batcher plans (and takes from the
        queue) on the loop, without waiting for anything once it wakes, so a batch it would
        start has left the queue by then."""
        for _ in range(turns):
            await asyncio.sleep(0)

    def sample(self, name: str) -> float | None:
        return self.registry.get_sample_value(name)

    async def close(self) -> None:
        self.model.gate.set()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        for thread in self.threads:
            thread.close()


@pytest.fixture
async def pair():
    made: list[Pair] = []

    def make(**kwargs) -> Pair:
        made.append(Pair(**kwargs))
        return made[-1]

    yield make
    for one in made:
        await one.close()


async def test_work_that_waits_runs_in_two_passes_at_once_each_on_its_share(pair):
    p = pair(max_items=4)
    pendings = p.submit([f"t{i}" for i in range(8)])  # two batches of 4
    p.start()
    await p.until(lambda: p.model.running == 2)
    assert p.sample("batchfit_cpu_passes") == 2
    p.model.gate.set()
    outputs = await asyncio.wait_for(asyncio.gather(*(x.future for x in pendings)), TIMEOUT)
    assert outputs == [f"beside:t{i}" for i in range(8)]
    assert [(kind, len(texts)) for kind, texts, _ in p.model.passes] == [("beside", 4)] * 2
    assert p.sample("batchfit_side_by_side_batches_total") == 2


async def test_a_batch_with_nothing_else_waiting_runs_alone_and_nothing_starts_beside_it(pair):
    p = pair(max_items=4)
    first = p.submit(["alone"])
    p.start()
    await p.until(lambda: p.model.running == 1)
    later = p.submit([f"t{i}" for i in range(8)])
    await p.loop_turns()
    assert len(p.queue) == 8 and p.model.running == 1  # nothing planned beside the lone pass
    p.model.gate.set()
    await asyncio.wait_for(asyncio.gather(*(x.future for x in first + later)), TIMEOUT)
    assert first[0].future.result() == "alone:alone"
    assert [(kind, len(texts)) for kind, texts, _ in p.model.passes] == [
        ("alone", 1), ("beside", 4), ("beside", 4),
    ]  # fmt: skip
    assert p.model.passes[0][2] == 0
    assert p.sample("batchfit_side_by_side_batches_total") == 2


async def test_a_batch_that_does_not_fit_beside_the_running_pass_waits_for_it(pair):
    # 5 tokens an input at 1 KiB a token: a batch of 4 is predicted at 20 KiB; with 22 KiB
    # free, one input (5 KiB) cannot run beside it.
    p = pair(max_items=4, free_bytes=22 * KIB)
    pendings = p.submit([f"a{i} b c" for i in range(8)])
    p.start()
    await p.until(lambda: p.model.running == 1)
    await p.loop_turns()
    assert len(p.queue) == 4 and p.model.running == 1  # the second batch waits, still queued
    p.model.gate.set()
    await asyncio.wait_for(asyncio.gather(*(x.future for x in pendings)), TIMEOUT)
    # The first went beside (work waited), the second alone once the first had ended.
    assert [(kind, running) for kind, _, running in p.model.passes] == [
        ("beside", 0), ("alone", 0),
    ]  # fmt: skip
    assert p.model.most_at_once == 1


async def test_a_device_error_beside_another_pass_ends_every_item_and_the_batcher(pair):
    p = pair(max_items=4)
    pendings = p.submit([f"t{i}" for i in range(8)])
    p.model.fail_on = "t5"
    p.start()
    await p.until(lambda: p.model.running == 2)
    p.model.gate.set()
    assert p.task is not None
    with pytest.raises(DeviceError):
        await asyncio.wait_for(p.task, TIMEOUT)
    assert not p.batcher.healthy
    assert all(x.future.done() for x in pendings)
    for x in pendings[:4]:  # the other pass: answered, or failed as the batcher ended
        assert x.future.exception() is None or isinstance(x.future.exception(), InferenceFailed)
    for x in pendings[4:]:
        with pytest.raises(InferenceFailed):
            x.future.result()


async def test_stopping_the_batcher_fails_the_items_of_every_pass_running(pair):
    p = pair(max_items=4)
    pendings = p.submit([f"t{i}" for i in range(8)])
    p.start()
    await p.until(lambda: p.model.running == 2)
    assert p.task is not None
    p.task.cancel()
    await asyncio.gather(p.task, return_exceptions=True)
    for x in pendings:
        with pytest.raises(ShuttingDown):
            x.future.result()


def _budget(shared_bytes: float | None, max_items: int = 128, max_tokens: int = 4096):
    return BatchBudget(
        max_items=max_items, max_tokens=max_tokens, max_bytes=100.0,
        predict_bytes=lambda n, length: float(n * length), shared_bytes=shared_bytes,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("shared_bytes", "passes", "roomy"),
    [
        # The largest batch the caps allow is 4096 tokens: 4096 bytes at a byte a token.
        (4 * 4096, 2, True),
        (4 * 4096 - 1, 2, False),
        (8 * 4096, 4, True),
        (8 * 4096 - 1, 4, False),
        (None, 2, False),  # nothing tells what memory is free
    ],
)
def test_passes_go_side_by_side_where_memory_cannot_bind_them(shared_bytes, passes, roomy):
    assert room_for_passes(_budget(shared_bytes), passes, max_len=256) is roomy


def test_a_side_pass_runs_on_its_share_of_the_threads_and_restores_the_callers():
    from models import current_cpu_threads, set_cpu_threads
    from server.runtime.threads import on_threads

    seen: list[int] = []
    interrupted: list[bool] = []

    def forward(items):
        seen.append(current_cpu_threads())
        return list(items)

    def on_its_own_thread() -> None:
        set_cpu_threads(2)
        side = on_threads(forward, 1, lambda: interrupted.append(True))
        assert side(["a"]) == ["a"]
        seen.append(current_cpu_threads())

    thread = threading.Thread(target=on_its_own_thread)
    thread.start()
    thread.join(TIMEOUT)
    assert seen == [1, 2]  # one thread in the pass, the caller's two after it
    assert interrupted == [True]  # the thread guard hears of every pass side by side


@pytest.mark.parametrize(
    ("threads", "requested", "shape"),
    [
        (2, 0, (2, 1)),  # by default one pass per thread...
        (16, 0, (4, 4)),  # ... up to 4, the threads shared out
        (1, 0, (1, 1)),  # one thread: one pass at a time
        (2, 1, (1, 2)),  # --cpu-passes 1: one at a time on every thread
        (8, 2, (2, 4)),
        (2, 8, (2, 1)),  # never more passes than threads
    ],
)
def test_passes_at_once_and_threads_each(threads, requested, shape):
    from server.runtime.threads import side_shape

    assert side_shape(threads, requested) == shape
