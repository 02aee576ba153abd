"""The batcher with memory: scripted probes and OOMs for exact sequences, and a real model."""

import asyncio

import numpy as np
import pytest

from batching import (
    AdaptiveConfig,
    AdaptiveSizer,
    BatchOutcome,
    CompositeProbe,
    MemoryLimit,
    OutOfMemory,
    PeakModel,
)
from models import ModelOutOfMemory, ModelSpec, load_model
from models.testing import save_tiny_model
from tests.fakes import ScriptedModel, ScriptedProbe
from tests.test_probes import FlakyProbe

TIMEOUT = 10
MiB = 2**20


def sample(h, name, **labels):
    return h.registry.get_sample_value(name, labels)


async def test_split_sequence_metrics_and_cache_release(harness_factory):
    model = ScriptedModel(oom_above_items=8)
    probe = ScriptedProbe(free_bytes=2**40)
    h = harness_factory(model=model, probe=probe)
    pendings = h.submit([f"t{i}" for i in range(32)])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert model.batch_sizes == [32, 16, 8, 8, 16, 8, 8]
    assert all(p.future.done() and not p.future.exception() for p in pendings)
    assert sample(h, "batchfit_oom_events_total", outcome="split", model="scripted") == 3
    assert sample(h, "batchfit_oom_events_total", outcome="failed", model="scripted") == 0
    assert probe.released == 3  # the cache is emptied after every OOM


async def test_without_splitting_an_oom_fails_the_whole_batch(harness_factory):
    model = ScriptedModel(oom_above_items=2)
    h = harness_factory(model=model, oom_split=False)
    pendings = h.submit(["a", "b", "c", "d"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert model.batch_sizes == [4]
    for p in pendings:
        with pytest.raises(OutOfMemory, match="in a batch of 4"):
            p.future.result()
    assert sample(h, "batchfit_oom_events_total", outcome="failed", model="scripted") == 1


async def test_the_binding_limit_is_one_gauge_series_labelled_by_its_source(harness_factory):
    probe = ScriptedProbe(2**30, MemoryLimit("host", 16 * 2**30, "memory"))
    h = harness_factory(model=ScriptedModel(), probe=probe)
    h.submit(["a"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert sample(h, "batchfit_memory_limit_bytes", source="host") == 16 * 2**30
    # A cgroup limit set while serving binds from the next batch on; the host's series goes.
    probe.limit = MemoryLimit("cgroup", 630 * 2**20, "/system.slice/x.service")
    h.submit(["b"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert sample(h, "batchfit_memory_limit_bytes", source="cgroup") == 630 * 2**20
    assert sample(h, "batchfit_memory_limit_bytes", source="host") is None


class TakesMemory(ScriptedModel):
    """While its next forward pass runs, someone else takes memory: ``probe`` then reads
    ``free_bytes`` (once)."""

    def __init__(self, probe):
        super().__init__()
        self.probe, self.free_bytes = probe, None

    def forward(self, items):
        if self.free_bytes is not None:
            self.probe.free_bytes, self.free_bytes = self.free_bytes, None
        return super().forward(items)


def memory_taken_in_the_first_batch(harness_factory, **kwargs):
    """30 inputs of 3 tokens, 1 MiB each (prior: alpha = 1 MiB / 3 tokens), 10% headroom:
    10 MiB free sizes 9 items, 4 MiB free 3; someone else takes 6 MiB while the first batch
    runs."""
    prior = PeakModel(alpha=2**20 / 3, beta=0.0)
    sizer = AdaptiveSizer(
        prior,
        AdaptiveConfig(max_items=32, max_tokens=10_000, headroom_fraction=0.1, safety_factor=1.0),
    )
    probe = ScriptedProbe(free_bytes=10 * 2**20)
    model = TakesMemory(probe)
    h = harness_factory(model=model, sizer=sizer, probe=probe, **kwargs)
    h.submit(["w"] * 30)
    model.free_bytes = 4 * 2**20
    return h, model, probe


async def test_adaptive_budget_follows_free_memory(harness_factory, clock):
    h, model, probe = memory_taken_in_the_first_batch(harness_factory)
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    # The reading taken on the model thread just after that batch sizes the next one.
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert model.batch_sizes == [9, 3]
    assert h.batcher.num_loop_readings == 1  # the first batch's; the second came with it
    assert sample(h, "batchfit_batch_budget_bytes", model="scripted") == pytest.approx(
        0.9 * 4 * 2**20
    )
    assert sample(h, "batchfit_memory_free_bytes") == 4 * 2**20
    assert sample(h, "batchfit_batch_predicted_peak_bytes", model="scripted") == pytest.approx(
        3 * 2**20
    )
    assert sample(h, "batchfit_memory_headroom_bytes", model="scripted") == pytest.approx(2**20)
    # Memory freed while idle for longer than a reading stays fresh: the loop reads again.
    probe.free_bytes = 10 * 2**20
    clock.advance(h.batcher.config.max_reading_age_s * 2)
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert model.batch_sizes == [9, 3, 9]
    assert h.batcher.num_loop_readings == 2
    # Back to the first batch's budget: the gauges show it again.
    assert sample(h, "batchfit_batch_budget_bytes", model="scripted") == pytest.approx(
        0.9 * 10 * 2**20
    )
    assert sample(h, "batchfit_batch_predicted_peak_bytes", model="scripted") == pytest.approx(
        9 * 2**20
    )


async def test_within_the_reading_interval_batches_are_sized_from_the_latest_reading(
    harness_factory, clock
):
    h, model, _ = memory_taken_in_the_first_batch(harness_factory, min_reading_interval_s=0.05)
    for advance_s in (0.0, 0.0, 0.06, 0.0):
        clock.advance(advance_s)
        await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    # The loop's reading (0 s old) sizes the first two; 0.06 s on, the model thread reads
    # again after the third (still fresh enough to size it), and its reading sizes the fourth.
    assert model.batch_sizes == [9, 9, 9, 3]
    assert h.batcher.num_loop_readings == 1


class CostlyProbe(ScriptedProbe):
    """A scripted probe whose every reading takes ``cost_s`` on ``clock``."""

    def __init__(self, clock, cost_s, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.cost_s, self.reads = clock, cost_s, 0

    def read(self):
        self.reads += 1
        self.clock.advance(self.cost_s)
        return super().read()


@pytest.mark.parametrize(
    ("cost_s", "share", "interval_s", "reads"),
    [
        (0.0002, None, 0.005, 20),  # the interval alone: after each batch, 10 ms apart
        (0.0002, 0.01, 0.02, 10),  # 0.2 ms a reading, 1% of the time: 20 ms apart
        (0.002, 0.01, 0.05, 5),  # 2 ms would be 200 ms apart: held to half the 0.1 s age
    ],
)
async def test_readings_take_at_most_their_share_of_the_model_threads_time(
    harness_factory, clock, cost_s, share, interval_s, reads
):
    probe = CostlyProbe(clock, cost_s, free_bytes=2**40)
    h = harness_factory(probe=probe, min_reading_interval_s=0.005, max_reading_share=share)
    for _ in range(20):
        h.submit(["a"])
        await asyncio.wait_for(h.batcher.step(), TIMEOUT)
        clock.advance(0.01 - cost_s)  # a batch every 10 ms where it read, a little more if not
    assert h.batcher.memory.interval_s() == pytest.approx(interval_s)
    assert probe.reads == reads
    assert h.batcher.num_loop_readings == 1  # the first batch's: the model thread read the rest


async def test_after_a_failed_batch_the_next_is_sized_from_a_new_reading(harness_factory):
    probe = ScriptedProbe(free_bytes=2**40)
    h = harness_factory(model=ScriptedModel(oom_above_items=2), probe=probe, oom_split=False,
                        min_reading_interval_s=60.0)  # fmt: skip
    h.submit(["a", "b", "c", "d"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)  # runs out of memory: no reading
    h.submit(["e"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert h.batcher.num_loop_readings == 2


class OomAbove:
    """A real model that raises our OOM error for batches above ``limit`` items."""

    def __init__(self, model, limit):
        self.model, self.limit, self.sizes = model, limit, []

    def forward(self, items):
        self.sizes.append(len(items))
        if len(items) > self.limit:
            raise ModelOutOfMemory("scripted", requested_bytes=None)
        return self.model.forward(items)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(
        ModelSpec(model=str(save_tiny_model(tmp_path_factory.mktemp("m"))), device="cpu")
    )


async def test_outputs_after_a_split_equal_the_unsplit_outputs(harness_factory, tiny_model):
    texts = ["short", "a much longer sentence than the others in this batch", "mid length text",
             "x", "another sentence", "the last one"]  # fmt: skip
    items = tiny_model.prepare(texts, truncate=True)
    unsplit = tiny_model.forward(items)
    wrapped = OomAbove(tiny_model, limit=2)
    h = harness_factory(model=wrapped)
    pendings = h.submit(texts)
    for pending, item in zip(pendings, items, strict=True):
        pending.item = item
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert wrapped.sizes == [6, 3, 1, 2, 3, 1, 2]
    for pending, expected in zip(pendings, unsplit, strict=True):
        np.testing.assert_allclose(pending.future.result(), expected, atol=1e-5)


async def test_while_the_probe_fails_the_budget_keeps_its_last_reading_and_the_ceiling(
    harness_factory, clock
):
    """One read error must not turn memory-awareness off: the batch sizes keep following the
    last reading, under the ceiling proven at warm-up, and the probe is read again later."""
    flaky = FlakyProbe(free_bytes=5 * MiB)  # 1 MiB per item; 10% headroom: 4 items
    probe = CompositeProbe([flaky], clock=clock.now, retry_initial_s=1, retry_max_s=1)
    config = AdaptiveConfig(max_items=64, max_tokens=10**6, headroom_fraction=0.1,
                            safety_factor=1.0)  # fmt: skip
    sizer = AdaptiveSizer(PeakModel(alpha=MiB / 3, beta=0), config)
    sizer.calibrate(BatchOutcome(6, 3, 0.0, 6 * MiB))
    sizer.finish_warm_up()  # proven: 6 items
    model = ScriptedModel()
    h = harness_factory(model=model, sizer=sizer, probe=probe)

    async def sizes(num_items):
        before = len(model.batch_sizes)
        h.submit(["x"] * num_items)  # 3 tokens each
        while len(h.queue):
            await asyncio.wait_for(h.batcher.step(), TIMEOUT)
        return model.batch_sizes[before:]

    assert await sizes(10) == [4, 4, 2]
    assert sample(h, "batchfit_probe_error", probe="flaky") == 0
    flaky.failing, flaky.free_bytes = True, 20 * MiB
    # The last reading (5 MiB), not the ceiling alone (6) nor the memory now (20).
    assert await sizes(10) == [4, 4, 2]
    assert sample(h, "batchfit_probe_error", probe="flaky") == 1
    flaky.free_bytes = 3 * MiB
    assert await sizes(3) == [3]  # not read again before its retry
    flaky.failing = False
    clock.advance(1.0)  # the retry reads again
    assert await sizes(5) == [2, 2, 1]
    assert sample(h, "batchfit_probe_error", probe="flaky") == 0
    flaky.free_bytes = 20 * MiB
    # Past the age at which the reading taken after the last batch still sizes the next one.
    clock.advance(h.batcher.config.max_reading_age_s + 0.1)
    assert await sizes(7) == [6, 1]  # plenty free: the proven ceiling binds


class PeakProbe(ScriptedProbe):
    """A scripted probe that measures batch peaks, each half taking ``cost_s`` on ``clock``."""

    def __init__(self, clock, cost_s, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.cost_s, self.measured = clock, cost_s, 0

    def start_batch(self):
        self.measured += 1
        self.clock.advance(self.cost_s)
        return 100

    def batch_peak(self):
        self.clock.advance(self.cost_s)
        return 150


@pytest.mark.parametrize(
    ("forward_s", "measured"),
    [
        # 0.1 ms a half: 0.2 ms against a 1 ms pass is 20%, above the 1% share. The first
        # batch of each shape is measured, then none it covers for half the reading age
        # (50 ms): a longer batch; a larger one; 60 ms on, the first shape again.
        (0.001, [True, False, False, True, True, False, True]),
        # 0.2 ms against a 50 ms pass is 0.4%: every batch is measured.
        (0.05, [True] * 7),
    ],
)
async def test_a_batch_is_measured_unless_that_costs_more_than_its_share_and_its_shape_was(
    harness_factory, clock, forward_s, measured
):
    probe = PeakProbe(clock, 0.0001, free_bytes=2**40)
    model = ScriptedModel(clock=clock, seconds=lambda n, length: forward_s)
    h = harness_factory(model=model, probe=probe, max_reading_share=0.01)
    seen = []
    for texts, advance_s in [
        (["a"], 0.0), (["a"], 0.0), (["b"], 0.0),  # one word each: the same shape
        (["a b c"], 0.0),  # longer
        (["a", "b"], 0.0),  # two items
        (["c"], 0.0),  # covered by both
        (["a"], 0.06),  # the measured shapes have aged out
    ]:  # fmt: skip
        clock.advance(advance_s)
        before = probe.measured
        h.submit(texts)
        await asyncio.wait_for(h.batcher.step(), TIMEOUT)
        seen.append(probe.measured > before)
    assert seen == measured
    assert h.batcher.memory.num_unmeasured == measured.count(False)
    assert h.batcher.memory.measure_cost_s == pytest.approx(0.0002)


async def test_after_a_failed_batch_every_shape_is_measured_again(harness_factory, clock):
    probe = PeakProbe(clock, 0.0001, free_bytes=2**40)
    model = ScriptedModel(clock=clock, seconds=lambda n, length: 0.001, oom_above_items=2)
    h = harness_factory(model=model, probe=probe, max_reading_share=0.01, oom_split=False)
    seen = []
    for texts in (["a"], ["b"], ["a", "b", "c"], ["c"]):  # the third runs out of memory
        before = probe.measured
        h.submit(texts)
        await asyncio.wait_for(h.batcher.step(), TIMEOUT)
        seen.append(probe.measured > before)
    assert seen == [True, False, True, True]


async def test_a_batch_run_unmeasured_still_releases_the_cache_when_it_runs_out_of_memory(
    harness_factory, clock
):
    probe = PeakProbe(clock, 0.0001, free_bytes=2**40)
    model = ScriptedModel(clock=clock, seconds=lambda n, length: 0.001)
    h = harness_factory(model=model, probe=probe, max_reading_share=0.01, oom_split=False)
    for _ in range(2):
        h.submit(["a"])
        await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert (probe.measured, h.batcher.memory.num_unmeasured) == (1, 1)
    model.oom_above_tokens = 1
    (pending,) = h.submit(["a"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert probe.measured == 1  # not measured
    assert isinstance(pending.future.exception(), OutOfMemory) and probe.released == 1
