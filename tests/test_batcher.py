import asyncio
import threading

import pytest

from batching import DeadlineExceeded, FixedSizer, InferenceFailed, OutOfMemory, ShuttingDown
from models import DeviceError
from tests.fakes import ScriptedModel, ScriptedProbe
from tests.test_frontend import counting_threadsafe_calls

TIMEOUT = 10  # guard against hangs only


async def test_prefilled_queue_runs_as_one_batch_in_order(harness_factory):
    h = harness_factory()
    pendings = h.submit([f"text {i}" for i in range(10)])
    assert await asyncio.wait_for(h.batcher.step(), TIMEOUT) == 10
    assert h.model.batch_sizes == [10]
    assert [p.future.result() for p in pendings] == [f"out:text {i}" for i in range(10)]
    assert h.model_sample("batchfit_batch_size_count") == 1
    assert h.model_sample("batchfit_batch_size_sum") == 10
    assert h.sample("batchfit_queue_depth") == 0


async def test_waits_for_fill_window_from_the_first_item(harness_factory, clock):
    h = harness_factory(max_wait_s=0.005)
    h.submit(["a"])
    start = clock.now()
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    # The fake clock jumped exactly to the first item's deadline: nothing more arrived.
    assert clock.now() == pytest.approx(start + 0.005)
    assert h.model.batch_sizes == [1]


async def test_full_batch_does_not_wait(harness_factory, clock):
    h = harness_factory(sizer=FixedSizer(max_items=4, max_tokens=1000))
    h.submit(["a"] * 6)
    start = clock.now()
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert clock.now() == start
    assert h.model.batch_sizes == [4]
    assert len(h.queue) == 2


async def test_token_budget_groups_similar_lengths(harness_factory):
    h = harness_factory(sizer=FixedSizer(max_items=32, max_tokens=40))
    short = "w"  # 3 tokens
    long = " ".join(["w"] * 18)  # 20 tokens
    pendings = h.submit([short, long, short, long, short])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert h.model.batch_sizes == [3, 2]
    assert all(p.future.done() for p in pendings)


async def test_oom_splits_in_halves_until_it_fits(harness_factory):
    model = ScriptedModel(oom_above_items=8)
    h = harness_factory(model=model)
    texts = [f"t{i}" for i in range(32)]
    pendings = h.submit(texts)
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert model.batch_sizes == [32, 16, 8, 8, 16, 8, 8]
    assert [p.future.result() for p in pendings] == [f"out:{t}" for t in texts]
    assert model.seen == texts  # each input ran exactly once, in order
    # Each input knows the pass that answered it and when its first pass started.
    assert [p.batch for p in pendings[:9]] == [(3, 8)] * 8 + [(4, 8)]
    assert pendings[-1].batch == (7, 8)
    assert {p.started_s for p in pendings} == {h.clock.now()}


async def test_single_item_that_never_fits_gets_out_of_memory_alone(harness_factory):
    model = ScriptedModel(oom_above_tokens=10)
    h = harness_factory(model=model)
    huge = " ".join(["w"] * 20)  # 22 tokens: over the limit even alone
    pendings = h.submit(["a", "b", huge, "c"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert model.batch_sizes == [4, 2, 2, 1, 1]
    assert [p.future.result() for p in pendings[:2]] == ["out:a", "out:b"]
    assert pendings[3].future.result() == "out:c"
    with pytest.raises(OutOfMemory, match=r"input 2 \(22 tokens\) does not fit.*1\.0 MiB"):
        pendings[2].future.result()


async def test_cancelled_items_never_reach_the_model(harness_factory):
    h = harness_factory()
    pendings = h.submit(["a", "b", "c"])
    pendings[1].future.cancel()
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert h.model.seen == ["a", "c"]
    assert h.model.batch_sizes == [2]


async def test_expired_items_fail_with_deadline_without_running(harness_factory, clock):
    h = harness_factory()
    stale = h.submit(["stale"], timeout_s=0.001)
    fresh = h.submit(["fresh"], timeout_s=60)
    clock.advance(1.0)
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    with pytest.raises(DeadlineExceeded):
        stale[0].future.result()
    assert fresh[0].future.result() == "out:fresh"
    assert h.model.seen == ["fresh"]


async def test_model_error_fails_the_batch_and_the_loop_goes_on(harness_factory):
    model = ScriptedModel(fail_with=ValueError("boom"))
    h = harness_factory(model=model)
    first = h.submit(["a", "b"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    for p in first:
        with pytest.raises(InferenceFailed):
            p.future.result()
    assert h.batcher.healthy
    assert h.model_sample("batchfit_batch_failures_total") == 1
    model.fail_with = None
    second = h.submit(["c"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert second[0].future.result() == "out:c"


async def test_a_device_error_fails_its_batch_and_everything_queued_and_ends_the_loop(
    harness_factory,
):
    """A device that failed cannot be trusted with the next batch: ``run`` fails what it
    holds and raises, for the owner to stop the process (a model error, above, does not)."""
    h = harness_factory(
        model=ScriptedModel(fail_with=DeviceError("CUDA error: illegal address")),
        sizer=FixedSizer(max_items=2, max_tokens=10_000),
    )
    running = h.submit(["a", "b"])
    queued = h.submit(["c", "d", "e"], request_id="later")  # more than one batch holds
    with pytest.raises(DeviceError):
        await asyncio.wait_for(h.batcher.run(), TIMEOUT)
    assert not h.batcher.healthy
    assert h.model.batch_sizes == [2]  # nothing ran on the device after the error
    for pending in running + queued:
        with pytest.raises(InferenceFailed, match="the device failed; this replica is stopping"):
            pending.future.result()
    assert len(h.queue) == 0


async def test_wrong_output_count_fails_instead_of_misrouting(harness_factory):
    model = ScriptedModel()
    model.forward = lambda items: ["only one"]
    h = harness_factory(model=model)
    pendings = h.submit(["a", "b"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    for p in pendings:
        with pytest.raises(InferenceFailed, match="wrong number of outputs"):
            p.future.result()


async def test_result_for_a_request_gone_mid_batch_is_dropped(harness_factory):
    gate = threading.Event()
    h = harness_factory(model=ScriptedModel(gate=gate))
    pendings = h.submit(["a", "b"])
    step = asyncio.create_task(h.batcher.step())
    while len(h.queue):
        await asyncio.sleep(0.001)  # poll until the batch left the queue
    pendings[0].future.cancel()
    gate.set()
    await asyncio.wait_for(step, TIMEOUT)
    assert pendings[1].future.result() == "out:b"
    assert h.sample("batchfit_cancelled_items_total", {"stage": "running"}) == 1


async def test_stopping_the_loop_fails_what_is_still_queued(harness_factory):
    gate = threading.Event()
    h = harness_factory(model=ScriptedModel(gate=gate), sizer=FixedSizer(1, 100))
    pendings = h.submit(["a", "b", "c"])
    task = asyncio.create_task(h.batcher.run())
    while len(h.queue) == 3:
        await asyncio.sleep(0.001)
    task.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, TIMEOUT)
    # The running item and the two still queued all end.
    for p in pendings:
        with pytest.raises(ShuttingDown):
            p.future.result()


async def test_plans_by_time_once_the_model_is_fitted(harness_factory, clock):
    # 13 ms a pass and 0.25 ms a padded token, as the bundled model on our 2-core host.
    model = ScriptedModel(clock=clock, seconds=lambda n, length: 0.013 + 0.00025 * n * length)
    h = harness_factory(model=model, max_wait_s=0, plan_by_time=True)
    words = {length: " ".join(["w"] * (length - 2)) for length in (8, 10, 12, 30, 35, 60)}
    # Eight batches of varied shapes fit the model.
    for shape in ([8], [8, 8], [30] * 3, [60], [12] * 4, [35, 35], [10] * 6, [60, 60]):
        h.submit([words[length] for length in shape])
        await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert h.batcher.lanes["scripted"].time_model.coefficients == pytest.approx(
        (0.013, 0.00025, 0), abs=1e-9
    )
    # Two passes (10-12, then 30-35) beat one pass of all five padded to 35.
    pendings = h.submit([words[length] for length in (10, 30, 12, 35, 10)])
    model.batch_sizes.clear()
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert model.batch_sizes == [3, 2]
    assert all(p.future.done() for p in pendings)


async def test_answers_are_out_before_the_time_model_learns_from_the_batch(harness_factory):
    """A refit of the time model runs on the event loop; it must not delay the answers."""
    h = harness_factory(plan_by_time=True)
    pendings = h.submit(["a", "b b"])
    seen = []
    observe = h.batcher.lanes["scripted"].time_model.observe

    def spy(*args):
        seen.append([p.future.done() for p in pendings])
        observe(*args)

    h.batcher.lanes["scripted"].time_model.observe = spy
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert seen == [[True, True]]


async def test_the_next_batch_goes_to_the_model_before_the_last_ones_requests_resume(
    harness_factory, model_thread
):
    # The requests' own tasks encode their answers: the model does not idle meanwhile.
    h = harness_factory(sizer=FixedSizer(max_items=2, max_tokens=10_000))
    pendings = h.submit(["a", "b", "c", "d"])
    first = pendings[0]
    calls_before = model_thread.num_calls

    async def request():
        await first.future
        return model_thread.num_calls - calls_before

    waiting = asyncio.create_task(request())
    task = asyncio.create_task(h.batcher.run())
    try:
        assert await asyncio.wait_for(waiting, TIMEOUT) == 2  # its batch and the next
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert all(p.future.done() for p in pendings)
    assert [p.future.result() for p in pendings[:2]] == ["out:a", "out:b"]
    for p in pendings[2:]:  # the next batch answered, or the stop failed it
        error = p.future.exception()
        assert error is None or isinstance(error, ShuttingDown)


async def test_a_batch_goes_to_the_model_before_its_metrics_are_recorded(
    harness_factory, model_thread
):
    # What the pass does not need (its histograms, its queue waits) is recorded while the
    # model runs it, not before it starts.
    h = harness_factory()
    pendings = h.submit(["a", "b b"])
    metrics = h.batcher.lanes["scripted"].metrics
    calls_before = model_thread.num_calls
    handed = []
    for histogram in (metrics.queue_wait, metrics.batch_size):
        observe = histogram.observe

        def spy(value, observe=observe):
            handed.append(model_thread.num_calls - calls_before)
            observe(value)

        histogram.observe = spy
    assert await asyncio.wait_for(h.batcher.step(), TIMEOUT) == 2
    assert [p.future.result() for p in pendings] == ["out:a", "out:b b"]
    assert handed == [1, 1, 1]  # two queue waits and the batch's size, each after the hand-off


class SlowReadingProbe(ScriptedProbe):
    """Its peak and its reads on the model thread wait for ``release``. Each notes how many
    hand-backs to the loop (``counts``, from ``counting_threadsafe_calls``) came before it."""

    def __init__(self, counts):
        super().__init__(free_bytes=2**40)
        self.release = threading.Event()
        self.model_thread_calls = []
        self.handed_back_before = []
        self._counts = counts

    def _wait(self, what):
        if threading.current_thread() is not threading.main_thread():
            self.model_thread_calls.append(what)
            self.handed_back_before.append(self._counts["threadsafe"])
            assert self.release.wait(TIMEOUT)

    def start_batch(self):
        return 0

    def batch_peak(self):
        self._wait("peak")
        return 0

    def read(self):
        self._wait("read")
        return super().read()


async def wait_until(predicate):
    async with asyncio.timeout(TIMEOUT):
        while not predicate():
            await asyncio.sleep(0.001)


@pytest.mark.parametrize("due", [True, False], ids=["reading due", "no reading due"])
async def test_a_lone_batchs_answers_go_back_before_the_memory_measurement_after_it(
    harness_factory, due
):
    with counting_threadsafe_calls(asyncio.get_running_loop()) as counts:
        probe = SlowReadingProbe(counts)
        # Due after every batch; or not for an hour, the loop's reading before it the latest.
        h = harness_factory(probe=probe, min_reading_interval_s=0 if due else 3600)
        pendings = h.submit(["a", "b b"])
        step = asyncio.create_task(h.batcher.step())
        try:
            await wait_until(lambda: all(p.future.done() for p in pendings))
            assert [p.future.result() for p in pendings] == ["out:a", "out:b b"]
            # The measurement starts once the answers are on their way back: wait for it.
            await wait_until(lambda: probe.model_thread_calls == ["peak"])
            assert not step.done()  # still measuring
        finally:
            probe.release.set()
        assert await asyncio.wait_for(step, TIMEOUT) == 2
    expected = ["peak", "read"] if due else ["peak"]
    assert probe.model_thread_calls == expected
    assert probe.handed_back_before == [1] * len(expected)  # the answers went back first
    assert counts["threadsafe"] == 2  # the answers, then the measurement
    assert h.batcher.num_loop_readings == 1  # the next batch is sized from the model thread's


class PeakAfterProbe(ScriptedProbe):
    """Notes, when the model thread reads a batch's peak, how often the batcher had asked
    whether its requests were answered (``asked``)."""

    def __init__(self, asked):
        super().__init__(free_bytes=2**40)
        self._asked = asked
        self.asked_at_peak = []

    def start_batch(self):
        return 0

    def batch_peak(self):
        if threading.current_thread() is not threading.main_thread():
            self.asked_at_peak.append(len(self._asked))
        return 0


@pytest.mark.parametrize(
    ("case", "asked"),
    [("answered on the third turn", 3), ("never answered", 8), ("work queued meanwhile", 2)],
)
async def test_the_measurement_after_a_lone_batch_waits_for_its_requests_answers(
    harness_factory, case, asked
):
    calls = []
    harness = {}

    def answered():
        calls.append(None)
        if case == "work queued meanwhile" and len(calls) == 2:
            harness["h"].submit(["next"])
        return case == "answered on the third turn" and len(calls) == 3

    probe = PeakAfterProbe(calls)
    h = harness["h"] = harness_factory(probe=probe, answered=answered)
    pendings = h.submit(["a"])
    assert await asyncio.wait_for(h.batcher.step(), TIMEOUT) == 1
    assert pendings[0].future.result() == "out:a"
    # Read on the model thread only once the loop let it: never beside the answers.
    assert probe.asked_at_peak == [asked]
    assert len(calls) == asked


class UnmeasuredProbe(SlowReadingProbe):
    """Measures no batch's peak (as where the batch's measurement would cost more than its
    share): a batch has nothing to measure but a reading."""

    def start_batch(self):
        return None


@pytest.mark.parametrize("case", ["work waits", "nothing to measure"])
async def test_the_measurement_after_a_batch_goes_back_with_its_answers(harness_factory, case):
    with counting_threadsafe_calls(asyncio.get_running_loop()) as counts:
        if case == "work waits":  # two batches: "b" waits while "a" runs
            probe = SlowReadingProbe(counts)
            h = harness_factory(probe=probe, sizer=FixedSizer(max_items=1, max_tokens=100))
            pendings = h.submit(["a", "b"])
        else:  # unmeasured, and the loop's reading before the batch is the latest for an hour
            probe = UnmeasuredProbe(counts)
            h = harness_factory(probe=probe, min_reading_interval_s=3600)
            pendings = h.submit(["a"])
        step = asyncio.create_task(h.batcher.step())
        try:
            if case == "work waits":
                await wait_until(lambda: probe.model_thread_calls)
                assert not pendings[0].future.done()
        finally:
            probe.release.set()
        assert await asyncio.wait_for(step, TIMEOUT) == 1
    assert pendings[0].future.result() == "out:a"
    assert probe.model_thread_calls == (["peak", "read"] if case == "work waits" else [])
    assert probe.handed_back_before == [0] * len(probe.model_thread_calls)  # nothing before
    assert counts["threadsafe"] == 1  # one hand-back: the answers and the measurement
