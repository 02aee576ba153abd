import asyncio

import pytest

from batching import NeverAdmitted, Pending, QueueFull, RequestQueue
from models import Item


def pending(loop, cost=3, priority=0):
    return Pending(
        item=Item(data="x", cost=cost), future=loop.create_future(), arrival_s=0.0,
        deadline_s=10.0, priority=priority,
    )  # fmt: skip


async def test_full_queue_rejects_whole_request_and_keeps_what_it_had():
    loop = asyncio.get_running_loop()
    queue = RequestQueue(3)
    queue.put_many([pending(loop), pending(loop)])
    with pytest.raises(QueueFull, match="2 of 3"):
        queue.put_many([pending(loop), pending(loop)])
    assert len(queue) == 2
    queue.put_many([pending(loop)])
    assert len(queue) == 3


async def test_orders_by_priority_then_arrival():
    loop = asyncio.get_running_loop()
    queue = RequestQueue(10)
    low1, high1, low2, high2 = (pending(loop, priority=p) for p in (0, 5, 0, 5))
    for p in (low1, high1, low2, high2):
        queue.put_many([p])
    assert queue.waiting() == [high1, high2, low1, low2]


async def test_cancelled_entries_are_dropped_and_free_capacity():
    loop = asyncio.get_running_loop()
    queue = RequestQueue(2)
    first, second = pending(loop), pending(loop)
    queue.put_many([first, second])
    first.future.cancel()
    assert queue.waiting() == [second]
    queue.put_many([pending(loop)])
    assert len(queue) == 2


async def test_wait_not_empty_wakes_on_put():
    loop = asyncio.get_running_loop()
    queue = RequestQueue(2)
    waiter = asyncio.create_task(queue.wait_not_empty())
    await asyncio.sleep(0)
    assert not waiter.done()
    queue.put_many([pending(loop)])
    await asyncio.wait_for(waiter, 5)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="at least 1, got 0"):
        RequestQueue(0)


async def test_a_request_larger_than_the_queue_is_never_admitted_not_full():
    loop = asyncio.get_running_loop()
    queue = RequestQueue(3)
    with pytest.raises(
        NeverAdmitted, match="4 inputs can never be admitted: the queue holds at most 3"
    ):
        queue.put_many([pending(loop) for _ in range(4)])
    queue.put_many([pending(loop) for _ in range(3)])  # exactly the capacity fits
    with pytest.raises(QueueFull):  # now full, but 1 would fit later
        queue.put_many([pending(loop)])


async def test_a_request_larger_than_its_models_share_is_never_admitted():
    loop = asyncio.get_running_loop()
    queue = RequestQueue(4, max_items_per_model=2)
    items = [pending(loop) for _ in range(3)]
    for item in items:
        item.model = "a"
    with pytest.raises(NeverAdmitted, match="model 'a' may hold at most 2 of the queue's items"):
        queue.put_many(items)
    assert len(queue) == 0
    queue.put_many(items[:2])
    with pytest.raises(QueueFull, match="holds its share"):
        queue.put_many(items[2:])
