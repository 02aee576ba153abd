"""One batcher, several models: which model runs next, batch-mates, per-model budgets and
queue shares, and fairness under a flood (a fake clock, scripted models, metrics read back)."""

import asyncio

import pytest

from batching import FixedSizer, QueueFull
from tests.fakes import ScriptedModel

TIMEOUT = 10


def two_models(harness_factory, clock=None, *, sizers=(None, None), **kwargs):
    a, b = (ScriptedModel(clock=clock, seconds=lambda n, length: 0.002 + 0.001 * n)
            for _ in range(2))  # fmt: skip
    h = harness_factory(model=a, lanes={"a": (a, sizers[0]), "b": (b, sizers[1])}, **kwargs)
    return h, a, b


async def test_the_oldest_item_picks_the_model_and_batch_mates_share_it(harness_factory, clock):
    h, a, b = two_models(harness_factory, clock)
    first_b = h.submit(["b1"], model="b")
    clock.advance(0.001)
    h.submit(["a1", "a2"], model="a")
    clock.advance(0.001)
    h.submit(["b2", "b3"], model="b")
    assert await asyncio.wait_for(h.batcher.step(), TIMEOUT) == 3
    assert b.seen == ["b1", "b2", "b3"] and a.seen == []
    assert first_b[0].future.result() == "out:b1"
    assert await asyncio.wait_for(h.batcher.step(), TIMEOUT) == 2
    assert a.seen == ["a1", "a2"]
    assert h.model_sample("batchfit_batch_size_count", model="a") == 1
    assert h.model_sample("batchfit_batch_size_sum", model="b") == 3


async def test_effective_priority_picks_before_arrival(harness_factory, clock):
    h, a, b = two_models(harness_factory, clock)
    h.submit(["a1"], model="a")
    clock.advance(0.001)
    h.submit(["b1"], model="b", priority=3)
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert b.seen == ["b1"] and a.seen == []


async def test_each_model_is_sized_by_its_own_sizer(harness_factory, clock):
    h, a, b = two_models(harness_factory, clock, sizers=(FixedSizer(2, 1000), FixedSizer(8, 1000)))
    h.submit([f"a{i}" for i in range(6)], model="a")
    h.submit([f"b{i}" for i in range(6)], model="b")
    for _ in range(4):
        await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert a.batch_sizes == [2, 2, 2] and b.batch_sizes == [6]


async def test_items_of_a_model_no_lane_serves_fail_and_the_loop_goes_on(harness_factory):
    h, _, _ = two_models(harness_factory)
    stray = h.submit(["x"], model="gone")
    good = h.submit(["a1"], model="a")
    assert await asyncio.wait_for(h.batcher.step(), TIMEOUT) == 0
    with pytest.raises(Exception, match="no model named 'gone'"):
        stray[0].future.result()
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert good[0].future.result() == "out:a1"


async def test_a_model_at_its_queue_share_is_refused_while_others_get_in(harness_factory):
    h, _, _ = two_models(harness_factory, queue_items=8, queue_items_per_model=4)
    h.submit(["a"] * 4, model="a")
    with pytest.raises(QueueFull, match="model 'a' holds its share"):
        h.submit(["a"], model="a")
    h.submit(["b"] * 4, model="b")
    with pytest.raises(QueueFull, match="8 of 8"):
        h.submit(["c"], model="b")


def p99_queue_wait(h, model):
    """The p99 of the model's queue wait as Prometheus would bound it: the upper bound of the
    bucket that holds the 99th percentile."""
    samples = [
        s for family in h.registry.collect() if family.name == "batchfit_queue_wait_seconds"
        for s in family.samples
        if s.name.endswith("_bucket") and s.labels["model"] == model
    ]  # fmt: skip
    total = samples[-1].value
    assert total > 0
    return next(float(s.labels["le"]) for s in samples if s.value >= 0.99 * total)


# Batches of 8 that take 2 ms + 1 ms per item (fake time): 10 ms each. With a share of 32
# items the flooded model holds at most 4 batches ahead of a trickle item, plus the one
# running when it arrives: 50 ms at most. Without a share it holds all 64 slots: 80 ms+.
FAIRNESS_BOUND_S = 0.05


@pytest.mark.parametrize(("share", "bounded"), [(32, True), (None, False)])
async def test_a_flood_to_one_model_keeps_the_trickle_to_another_bounded(
    harness_factory, clock, share, bounded
):
    h, _, _ = two_models(
        harness_factory, clock, sizers=(FixedSizer(8, 10_000), FixedSizer(8, 10_000)),
        queue_items=64, queue_items_per_model=share, max_wait_s=0,
    )  # fmt: skip
    next_trickle = start = clock.now()
    while clock.now() < start + 3.0:  # fake seconds: about 300 batches
        if clock.now() >= next_trickle:  # the trickle: one item to b every 25 ms
            h.submit(["trickle"], model="b")
            next_trickle += 0.025
        while True:  # the flood: model a's clients refill whatever room the queue gives them
            try:
                h.submit(["flood words here"], model="a")
            except QueueFull:
                break
        await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    p99 = p99_queue_wait(h, "b")
    assert (p99 <= FAIRNESS_BOUND_S) is bounded, p99
    assert h.model_sample("batchfit_queue_wait_seconds_count", model="b") >= 100
