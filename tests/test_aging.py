"""Priorities with aging: higher first, FIFO within a priority, low priority never starves."""

import asyncio

import pytest

from batching import FixedSizer, Pending, RequestQueue
from models import Item

TIMEOUT = 10


def pending(loop, name, *, priority=0, arrival_s=0.0):
    return Pending(
        item=Item(data=name, cost=3), future=loop.create_future(), arrival_s=arrival_s,
        deadline_s=1e9, priority=priority,
    )  # fmt: skip


def names(pendings):
    return [p.item.data for p in pendings]


async def test_later_work_overtakes_a_lower_item_only_within_the_aging_window():
    """Gap of 10 levels, 1s aging: high work arriving up to 10s after ``low`` goes first,
    high work arriving later does not. Within a priority, FIFO."""
    loop = asyncio.get_running_loop()
    queue = RequestQueue(10, priority_aging_s=1.0)
    for name, priority, arrival_s in [
        ("low", -5, 0.0), ("high@5", 5, 5.0), ("high@10", 5, 10.0), ("high@11", 5, 11.0),
        ("low@12", -5, 12.0),
    ]:  # fmt: skip
        queue.put_many([pending(loop, name, priority=priority, arrival_s=arrival_s)])
    # Ties (low vs high@10: both at level 15 at t=15) go to the older item.
    assert names(queue.waiting(now=15.0)) == ["high@5", "low", "high@10", "high@11", "low@12"]
    # Without ``now`` (or without aging) the base priorities rule.
    assert names(queue.waiting()) == ["high@5", "high@10", "high@11", "low", "low@12"]


async def test_without_aging_low_priority_waits_behind_any_high():
    loop = asyncio.get_running_loop()
    queue = RequestQueue(10)
    queue.put_many([pending(loop, "low", priority=-5, arrival_s=0.0)])
    queue.put_many([pending(loop, "high", priority=5, arrival_s=1000.0)])
    assert names(queue.waiting(now=2000.0)) == ["high", "low"]


def test_aging_must_be_positive():
    with pytest.raises(ValueError, match="positive, got 0"):
        RequestQueue(2, priority_aging_s=0)


async def test_low_priority_runs_within_the_aging_bound_under_a_stream_of_high(
    harness_factory, clock
):
    """High-priority work keeps arriving (one item a second, one item a batch); the low item,
    2 levels below with 1s aging, runs once the newest high work arrived 2s after it."""
    h = harness_factory(sizer=FixedSizer(max_items=1, max_tokens=1000), max_wait_s=0)
    h.batcher.queue.priority_aging_s = 1.0
    start = clock.now()
    low = h.submit(["low"], priority=-1)[0]
    h.submit(["high 0"], priority=1)
    for i in range(1, 10):
        await asyncio.wait_for(h.batcher.step(), TIMEOUT)
        if low.future.done():
            break
        clock.advance(1.0)
        h.submit([f"high {i}"], priority=1)
    assert low.future.result() == "out:low"
    assert clock.now() - start == 2.0
    assert h.model.seen[: h.model.seen.index("low")] == ["high 0", "high 1"]
