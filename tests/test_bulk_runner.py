"""The bulk model loop over a fake embedder and a scripted memory probe: outputs in input order,
OOM split, batches split when memory shrinks, and which peaks correct the memory model."""

import math
import threading

import numpy as np

from batching import MemoryLimit, MemoryReading
from bulk.runner import WARM_UP_MEMORY_SHARE, OutOfMemoryInput, Reserve, Runner, make_sizer
from tests.bulk_fakes import FakeEmbedder, expected_embedding

KIB = 1024
TEXTS = [" ".join(["w"] * n) for n in (1, 30, 2, 12, 30, 5, 1, 60, 3, 3, 45, 7)]


class Probe:
    """Free memory as the test sets it; each batch's peak as ``peak_of(batch size)``."""

    name = "test"

    def __init__(self, free_bytes=10**12, limit=None, peak=None) -> None:
        self.free_bytes = free_bytes
        self.limit = limit
        self.peak = peak
        self.frees: list[int] = []  # one free_bytes per read, when set: popped in order

    def read(self) -> MemoryReading:
        free = self.frees.pop(0) if self.frees else self.free_bytes
        return MemoryReading(
            free_bytes=free, used_bytes=0, limit=self.limit, enforced=self.limit,
            enforced_free_bytes=free if self.limit is not None else None,
        )  # fmt: skip

    def start_batch(self):
        return 0 if self.peak is not None else None

    def batch_peak(self):
        return self.peak


def runner_for(model, probe, *, max_items=128, max_tokens=4096, reserve=None):
    sizer = make_sizer(model, max_items=max_items, max_tokens=max_tokens, headroom=0.0)
    return Runner(model, sizer, probe, reserve=reserve)


def test_outputs_come_back_in_input_order_from_length_sorted_batches():
    model = FakeEmbedder()
    runner = runner_for(model, Probe())
    items = model.prepare(TEXTS, truncate=True)
    outputs = runner.run(items)
    assert all(
        np.array_equal(o, expected_embedding(t)) for o, t in zip(outputs, TEXTS, strict=True)
    )
    lengths = [len(t.split()) for batch in model.batches for t in batch]
    assert lengths == sorted(lengths)
    assert runner.stats.inputs == len(TEXTS)
    assert runner.stats.tokens == sum(item.cost for item in items)


def test_a_batch_that_runs_out_of_memory_is_split_down_to_one_input():
    # 40 padded tokens at most: the 62-token input cannot run even alone.
    model = FakeEmbedder(oom_above_tokens=40)
    runner = runner_for(model, Probe())
    outputs = runner.run(model.prepare(TEXTS, truncate=True))
    for text, output in zip(TEXTS, outputs, strict=True):
        if len(text.split()) + 2 > 40:
            assert isinstance(output, OutOfMemoryInput) and "out of memory" in output.reason
        else:
            assert np.array_equal(output, expected_embedding(text))
    assert runner.stats.oom_splits >= 1
    assert runner.stats.out_of_memory == sum(len(t.split()) + 2 > 40 for t in TEXTS)
    assert all(len(b) * max(len(t.split()) + 2 for t in b) <= 40 for b in model.batches)


def test_batches_are_split_before_they_run_when_memory_shrank_since_the_plan():
    """Planned with plenty free (one batch of 20), then room for 3 at a time: no batch runs
    over it and none needed an OOM to find out."""
    model = FakeEmbedder()
    probe = Probe()
    runner = runner_for(model, probe)
    texts = [f"text {i} " + "w " * 28 for i in range(20)]
    items = model.prepare(texts, truncate=True)
    predict = runner.sizer.predict
    room = predict(3, 32)
    probe.frees = [10**12]  # the plan's reading; every later read sees ``room``
    probe.free_bytes = math.ceil(room)  # room for 3 x 32 exactly, not a byte less
    outputs = runner.run(items)
    assert all(not isinstance(o, OutOfMemoryInput) for o in outputs)
    assert runner.stats.budget_splits >= 1 and runner.stats.oom_splits == 0
    assert sorted(len(b) for b in model.batches) == [2, 2, 2, 2, 3, 3, 3, 3]  # halves of 20
    for batch in model.batches:
        assert predict(len(batch), max(len(t.split()) + 2 for t in batch)) <= room


def test_a_lone_input_predicted_over_a_killing_limit_is_refused_without_running():
    model = FakeEmbedder()
    probe = Probe(free_bytes=1, limit=MemoryLimit("cgroup", 2**30, "/x"))
    runner = runner_for(model, probe)
    outputs = runner.run(model.prepare(["a b c"], truncate=True))
    assert isinstance(outputs[0], OutOfMemoryInput)
    assert "predicted to exceed memory" in outputs[0].reason
    assert model.batches == []


def test_only_a_quiet_batch_with_a_peak_well_over_the_model_corrects_it():
    model = FakeEmbedder()
    reserve = Reserve()
    probe = Probe(peak=2**30)  # far above any prediction
    runner = runner_for(model, probe, reserve=reserve)
    prior = runner.sizer.model
    items = model.prepare(["a b c"], truncate=True)
    with reserve.busy("reader", 0):
        runner.run(items)  # the reader allocated meanwhile: the peak is not the batch's
    assert runner.sizer.model == prior
    probe.peak = int(runner.sizer.model.predict(1, 5)) + 2**20  # over it, by noise only
    runner.run(items)
    assert runner.sizer.model == prior
    probe.peak = 2**30
    runner.run(items)
    assert runner.sizer.model.predict(1, 5) >= 2**30


def test_the_reserve_is_kept_out_of_the_budget():
    model = FakeEmbedder()
    reserve = Reserve()
    runner = runner_for(model, Probe(free_bytes=10 * 2**20), reserve=reserve)
    reserve.set("reader", 4 * 2**20)
    assert runner.read().free_bytes == 6 * 2**20
    with reserve.busy("writer", 2**20):
        assert runner.read().free_bytes == 5 * 2**20
    assert runner.read().free_bytes == 6 * 2**20


def test_warm_up_calibrates_the_sizer_and_proves_a_ceiling():
    model = FakeEmbedder(max_input_tokens=64)
    runner = runner_for(model, Probe(free_bytes=2**20, limit=MemoryLimit("cgroup", 2**21, "/x")))
    runner.warm_up()
    assert runner.sizer.proven_bytes is not None
    assert runner.sizer.ceiling_bytes == runner.sizer.proven_bytes <= 2**20


def warm_up_shapes(model):
    ran, forward = [], model.forward
    model.forward = lambda items: ran.append((len(items), items[0].cost)) or forward(items)
    runner = runner_for(model, Probe(free_bytes=None), max_items=128, max_tokens=4096)
    return ran, runner.warm_up()


def test_warm_up_climbs_the_servers_ladder_and_reports_the_longest_proven_length():
    """The server's warm-up: 32 tokens (a quarter batch first), then x4 to the maximum, each
    at the largest batch the caps allow, and one input alone at the longest length."""
    ran, report = warm_up_shapes(FakeEmbedder(max_input_tokens=512))
    assert ran == [(32, 32), (128, 32), (32, 128), (8, 512), (1, 512)]
    assert report.describe() == "longest proven input 512 tokens of 512"
    assert report.stopped is None


def largest_capped_peak(runner):
    """The largest predicted peak of any batch the caps (128 x 4096 tokens) allow, by brute
    force over every batch size at every length."""
    config, max_length = runner.sizer.config, runner.model.info.max_input_tokens
    return max(
        runner.sizer.predict(n, length)
        for length in range(1, max_length + 1)
        for n in range(1, config.max_items + 1)
        if n == 1 or n * length <= config.max_tokens
    )


def test_warm_up_is_skipped_where_the_caps_alone_bind_every_batch():
    model = FakeEmbedder(max_input_tokens=512)
    ran, forward = [], model.forward
    model.forward = lambda items: ran.append(len(items)) or forward(items)
    probe = Probe(free_bytes=0, limit=MemoryLimit("cgroup", 2**40, "/x"))
    runner = runner_for(model, probe)
    peak = largest_capped_peak(runner)
    probe.free_bytes = math.ceil(peak / WARM_UP_MEMORY_SHARE)  # headroom 0: the budget
    report = runner.warm_up()
    assert ran == []
    assert report.stopped.startswith("the largest batch the caps allow (8 x 512 tokens)")
    assert report.proven_length is None
    assert runner.sizer.proven_bytes is None and runner.sizer.ceiling_bytes == math.inf


def test_warm_up_runs_where_memory_could_bind_a_batch_or_cannot_be_read():
    """A byte less free than the skip needs, and the ladder runs; so it does with no free
    memory reading at all."""
    for free in ("short", None):
        model = FakeEmbedder(max_input_tokens=512)
        ran, forward = [], model.forward

        def counted(items, ran=ran, forward=forward):
            ran.append(len(items))
            return forward(items)

        model.forward = counted
        probe = Probe(free_bytes=None, limit=MemoryLimit("cgroup", 2**40, "/x"))
        runner = runner_for(model, probe)
        if free == "short":
            probe.free_bytes = math.ceil(largest_capped_peak(runner) / WARM_UP_MEMORY_SHARE) - 1
        report = runner.warm_up()
        assert ran, free
        assert report.proven_length == 512, free


def test_an_oom_in_warm_up_halves_the_batch_and_lowers_the_ceiling_it_then_stops_at():
    ran, report = warm_up_shapes(FakeEmbedder(max_input_tokens=512, oom_above_tokens=2048))
    assert ran == [(32, 32), (128, 32), (64, 32), (8, 128), (1, 128)]
    assert report.describe() == "longest proven input 128 tokens of 512"
    assert report.stopped.startswith("one input of 512 tokens is predicted to need")


def test_the_reserve_is_kept_out_of_the_room_a_lone_input_is_refused_by():
    reserve = Reserve()
    probe = Probe(free_bytes=10 * 2**20, limit=MemoryLimit("cgroup", 2**30, "/x"))
    runner = runner_for(FakeEmbedder(), probe, reserve=reserve)
    reserve.set("reader", 4 * 2**20)
    assert runner.read().enforced_free_bytes == 6 * 2**20


def test_a_lone_input_squeezed_out_waits_for_the_reader_and_a_release_before_a_refusal():
    """The next part being tokenized, then the holes a finished part left, take the room one
    input needs: it waits until the reader is done, memory is released, and it runs."""
    model = FakeEmbedder()
    probe = Probe(free_bytes=1, limit=MemoryLimit("cgroup", 2**30, "/x"))
    reserve = Reserve()
    busy_at_release = []

    def settle():  # the allocator's free memory handed back: room again
        busy_at_release.append(reserve.state()[0])
        probe.free_bytes = 2**30

    probe.settle = settle
    runner = runner_for(model, probe, reserve=reserve)
    reader_done = threading.Event()

    def reader():
        with reserve.busy("reader", 2**20):
            reader_done.wait(10)

    thread = threading.Thread(target=reader)
    thread.start()
    threading.Timer(0.2, reader_done.set).start()
    try:
        outputs = runner.run(model.prepare(["a b c"], truncate=True))
    finally:
        reader_done.set()
        thread.join()
    assert not isinstance(outputs[0], OutOfMemoryInput), outputs[0]
    np.testing.assert_allclose(outputs[0], expected_embedding("a b c"))
    assert busy_at_release == [0]  # released once the reader was no longer busy
