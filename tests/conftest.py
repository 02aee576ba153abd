import asyncio

import pytest
from prometheus_client import CollectorRegistry

from batching import (
    Batcher,
    BatcherConfig,
    BatchingMetrics,
    FixedSizer,
    MemoryMetrics,
    ModelThread,
    Pending,
    RequestQueue,
)
from models import DeviceError, Item, ModelOutOfMemory
from tests.fakes import FakeClock, ScriptedModel


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def model_thread():
    thread = ModelThread()
    yield thread
    thread.close()


class BatcherHarness:
    """A batcher over a scripted model, a fake clock and a pre-fillable queue."""

    def __init__(self, *, model, clock, registry, model_thread, sizer=None, queue_items=1024,
                 max_wait_s=0.005, probe=None, oom_split=True, plan_by_time=False):  # fmt: skip
        self.model = model
        self.clock = clock
        self.registry = registry
        self.queue = RequestQueue(queue_items)
        self.batcher = Batcher(
            queue=self.queue,
            forward=model.forward,
            model_thread=model_thread,
            sizer=sizer or FixedSizer(max_items=32, max_tokens=10_000),
            clock=clock,
            metrics=BatchingMetrics(registry, max_batch_size=32, max_batch_tokens=10_000),
            config=BatcherConfig(
                max_wait_s=max_wait_s, oom_split=oom_split, plan_by_time=plan_by_time
            ),
            oom_errors=(ModelOutOfMemory,),
            fatal_errors=(DeviceError,),
            probe=probe,
            memory_metrics=MemoryMetrics(registry),
        )

    def submit(self, texts, *, priority=0, timeout_s=60.0, request_id="r"):
        loop = asyncio.get_running_loop()
        now = self.clock.now()
        pendings = [
            Pending(
                item=Item(data=text, cost=len(text.split()) + 2),
                future=loop.create_future(),
                arrival_s=now,
                deadline_s=now + timeout_s,
                priority=priority,
                request_id=request_id,
                index=i,
            )
            for i, text in enumerate(texts)
        ]
        self.queue.put_many(pendings)
        return pendings

    def sample(self, name, labels=None):
        return self.registry.get_sample_value(name, labels or {})


@pytest.fixture
def harness_factory(clock, registry, model_thread):
    def make(model=None, **kwargs):
        return BatcherHarness(
            model=model or ScriptedModel(), clock=clock, registry=registry,
            model_thread=model_thread, **kwargs,
        )  # fmt: skip

    return make
