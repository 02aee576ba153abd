import asyncio

import pytest
from prometheus_client import CollectorRegistry

from batching import (
    Batcher,
    BatcherConfig,
    BatchingMetrics,
    FixedSizer,
    Lane,
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


MODEL = "scripted"


class BatcherHarness:
    """A batcher over a scripted model (or several, by name in ``lanes``: name -> (model,
    sizer)), a fake clock and a pre-fillable queue."""

    def __init__(self, *, model, clock, registry, model_thread, sizer=None, queue_items=1024,
                 max_wait_s=0.005, probe=None, oom_split=True, plan_by_time=False, lanes=None,
                 queue_items_per_model=None, min_reading_interval_s=0.0,
                 max_reading_share=None, answered=None):  # fmt: skip
        self.model = model
        self.clock = clock
        self.registry = registry
        self.queue = RequestQueue(queue_items, max_items_per_model=queue_items_per_model)
        lanes = lanes or {MODEL: (model, sizer)}
        self.batcher = Batcher(
            queue=self.queue,
            lanes=[
                Lane(name, m.forward, s or FixedSizer(max_items=32, max_tokens=10_000))
                for name, (m, s) in lanes.items()
            ],
            model_thread=model_thread,
            clock=clock,
            metrics=BatchingMetrics(registry, max_batch_size=32, max_batch_tokens=10_000),
            config=BatcherConfig(
                max_wait_s=max_wait_s,
                oom_split=oom_split,
                plan_by_time=plan_by_time,
                min_reading_interval_s=min_reading_interval_s,
                max_reading_share=max_reading_share,
            ),
            oom_errors=(ModelOutOfMemory,),
            fatal_errors=(DeviceError,),
            probe=probe,
            memory_metrics=MemoryMetrics(registry),
            answered=answered,
        )

    def submit(self, texts, *, priority=0, timeout_s=60.0, request_id="r", model=MODEL):
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
                model=model,
            )
            for i, text in enumerate(texts)
        ]
        self.queue.put_many(pendings)
        return pendings

    def sample(self, name, labels=None):
        return self.registry.get_sample_value(name, labels or {})

    def model_sample(self, name, labels=None, model=MODEL):
        """A series of one model (the metrics that carry a ``model`` label)."""
        return self.registry.get_sample_value(name, {"model": model, **(labels or {})})


@pytest.fixture
def harness_factory(clock, registry, model_thread):
    def make(model=None, **kwargs):
        return BatcherHarness(
            model=model or ScriptedModel(), clock=clock, registry=registry,
            model_thread=model_thread, **kwargs,
        )  # fmt: skip

    return make
