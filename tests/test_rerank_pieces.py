"""A request with more inputs than one piece (``--max-inputs-per-request``) enters the queue a
piece at a time: never more than two pieces of it at once, other requests admitted beside it
and queued between its pieces, a later piece waiting for room instead of a 429, and every
piece's items leaving the queue when the request ends early (its deadline, a failed input).

Driven as tests/test_request_deadlines.py drives the request path: no batcher, the test takes
items out of the queue and answers them as the batcher would."""

from __future__ import annotations

import asyncio

import pytest

from batching import InferenceFailed, Pending, ShuttingDown
from models import Item
from server.errors import ApiError
from tests.test_request_deadlines import MODEL, TIMEOUT, harness, until


def run_queued(h, count: int) -> list[Pending]:
    """What the batcher does with a batch of the ``count`` oldest: take, then answer them."""
    batch = h.queue.waiting(count)
    h.queue.remove(batch)
    for pending in batch:
        pending.future.set_result(f"out:{pending.item.data}")
    return batch


def owners(h) -> list[str]:
    return [pending.request_id for pending in h.queue.waiting()]


def foreign(count: int) -> list[Pending]:
    loop = asyncio.get_running_loop()
    return [
        Pending(item=Item(data=f"other {i}", cost=3), future=loop.create_future(),
                arrival_s=0.0, deadline_s=1e12, request_id="other", model=MODEL)
        for i in range(count)
    ]  # fmt: skip


BIG = [f"document {i}" for i in range(20)]


async def test_a_request_of_many_pieces_holds_two_at_most_and_lets_others_in_between():
    async with harness(inline_chars=float("inf"), queue_items=12, piece_items=4) as h:
        big = h.infer(BIG, timeout_s=TIMEOUT, request_id="big")
        await until(lambda: len(h.queue) == 8)
        small = h.infer(["a", "b", "c", "d"], timeout_s=TIMEOUT, request_id="small")
        await until(lambda: len(h.queue) == 12)  # admitted beside it: no 429
        assert owners(h) == ["big"] * 8 + ["small"] * 4
        run_queued(h, 4)
        # Its third piece queues behind the request that came between.
        await until(lambda: len(h.queue) == 12)
        assert owners(h) == ["big"] * 4 + ["small"] * 4 + ["big"] * 4
        deepest = 0
        while not big.done():
            deepest = max(deepest, sum(1 for owner in owners(h) if owner == "big"))
            run_queued(h, 4)
            await asyncio.sleep(0)
        outputs, _ = await big
        assert outputs == [f"out:{text}" for text in BIG]
        assert deepest <= 8
        assert (await small)[0] == ["out:a", "out:b", "out:c", "out:d"]


async def test_a_later_piece_waits_for_room_instead_of_failing():
    async with harness(inline_chars=float("inf"), queue_items=8, piece_items=4) as h:
        big = h.infer(BIG[:12], timeout_s=TIMEOUT, request_id="big")
        await until(lambda: len(h.queue) == 8)
        run_queued(h, 4)
        others = foreign(4)
        h.queue.put_many(others)  # the room goes to someone else first
        for _ in range(5):
            await asyncio.sleep(0)
        assert not big.done()
        assert owners(h) == ["big"] * 4 + ["other"] * 4
        h.queue.remove(others)  # taken into a batch: room again
        await until(lambda: owners(h) == ["big"] * 8)
        while not big.done():
            run_queued(h, 4)
            await asyncio.sleep(0)
        assert (await big)[0] == [f"out:{text}" for text in BIG[:12]]
        for pending in others:
            pending.future.cancel()


async def test_a_deadline_while_waiting_for_room_ends_it_and_empties_its_pieces():
    async with harness(inline_chars=float("inf"), queue_items=8, piece_items=4) as h:
        big = h.infer(BIG, timeout_s=0.2, request_id="big")
        await until(lambda: len(h.queue) == 8)
        run_queued(h, 4)
        others = foreign(4)
        h.queue.put_many(others)
        with pytest.raises(ApiError) as ended:
            async with asyncio.timeout(TIMEOUT):
                await big
        assert ended.value.error_type == "deadline_exceeded"
        assert owners(h) == ["other"] * 4  # its queued piece left with it
        for pending in others:
            pending.future.cancel()


async def test_a_failed_input_ends_the_request_and_its_later_pieces_never_enter():
    async with harness(inline_chars=float("inf"), queue_items=12, piece_items=4) as h:
        big = h.infer(BIG, timeout_s=TIMEOUT, request_id="big")
        await until(lambda: len(h.queue) == 8)
        first = h.queue.waiting(1)[0]
        h.queue.remove([first])
        first.future.set_exception(InferenceFailed("inference failed"))
        with pytest.raises(InferenceFailed):
            async with asyncio.timeout(TIMEOUT):
                await big
        assert len(h.queue) == 0
        assert h.queued.count("big") == 8  # its later pieces were never queued


async def test_a_drain_that_gives_up_ends_a_request_between_its_pieces():
    async with harness(inline_chars=float("inf"), queue_items=8, piece_items=4) as h:
        big = h.infer(BIG, timeout_s=TIMEOUT, request_id="big")
        await until(lambda: len(h.queue) == 8)
        run_queued(h, 8)  # every item it has queued is answered ...
        others = foreign(8)
        h.queue.put_many(others)  # ... and the queue is full: it waits with nothing open
        await asyncio.sleep(0)
        assert not big.done()
        h.work.fail_open(ShuttingDown("the server stopped before this input ran"))
        with pytest.raises(ShuttingDown):
            async with asyncio.timeout(TIMEOUT):
                await big
        h.queue.remove(others)
        for _ in range(5):
            await asyncio.sleep(0)
        assert h.queued.count("big") == 8  # nothing more of it entered the freed queue
        for pending in others:
            pending.future.cancel()
