"""A quiet replica hands the C allocator's free memory back: when it counts as quiet, that
the trim releases heap holes, and that the runtime does it after requests."""

import asyncio
import ctypes

import httpx
from prometheus_client import CollectorRegistry

from batching import MonotonicClock, release_host_memory
from server.runtime import WorkTracker
from tests.ci import unavailable
from tests.fakes import FakeClock, ScriptedModel
from tests.inprocess import serve_in_thread

TIMEOUT = 10  # guards against hangs only


async def settle() -> None:
    """Let every task that can run do so (nothing here sleeps: the clock is fake)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_quiet_means_a_request_ran_and_none_for_quiet_s_after_the_last_one_ended():
    clock = FakeClock()
    work = WorkTracker(CollectorRegistry(), clock=clock)
    waiter = asyncio.create_task(work.wait_quiet(5.0))
    await settle()
    assert not waiter.done()  # nothing ran since start: nothing to give back

    with work.request():
        with work.request():
            clock.advance(3.0)
        await settle()
        assert not waiter.done()  # one of the two is still in progress
        clock.advance(1.0)
    ended_s = clock.now()
    await asyncio.wait_for(waiter, TIMEOUT)
    assert clock.now() == ended_s + 5.0

    again = asyncio.create_task(work.wait_quiet(5.0))
    await settle()
    assert not again.done()  # the same quiet spell is not reported twice
    with work.request():
        pass
    await asyncio.wait_for(again, TIMEOUT)


class CountingClock(MonotonicClock):
    def __init__(self) -> None:
        self.waits = 0

    async def wait(self, event: asyncio.Event, deadline: float) -> bool:
        self.waits += 1
        return await super().wait(event, deadline)


async def test_requests_coming_and_going_do_not_wake_the_quiet_waiter_each_time():
    clock = CountingClock()
    work = WorkTracker(CollectorRegistry(), clock=clock)
    waiter = asyncio.create_task(work.wait_quiet(0.3))
    for _ in range(200):  # one client's requests, back to back
        with work.request():
            await asyncio.sleep(0)
        await asyncio.sleep(0)
    ended_s = clock.now()
    assert not waiter.done()
    await asyncio.wait_for(waiter, TIMEOUT)
    assert clock.now() >= ended_s + 0.3
    assert clock.waits <= 3  # a sleep or two until quiet, not one per request


def test_release_returns_the_free_holes_inside_the_heap():
    if release_host_memory() is None:
        unavailable("releasing free heap memory needs glibc")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = 64 * 2**10  # under glibc's default mmap threshold: from the heap
    blocks = [libc.malloc(block) for _ in range(1600)]
    for address in blocks:
        ctypes.memset(address, 1, block)  # resident
    # Every other block freed: 50 MiB of holes, none at the top, so malloc keeps them.
    for address in blocks[::2]:
        libc.free(address)
    try:
        released = release_host_memory()
    finally:
        for address in blocks[1::2]:
            libc.free(address)
    assert released >= 25 * 2**20


class HoleyModel(ScriptedModel):
    """Leaves 50 MiB of free holes in the C heap of the model thread for the input ``HOLES``
    (the other half of its blocks stays held until ``free``), as batches of many shapes do."""

    BLOCK = 64 * 2**10  # under glibc's mmap threshold: from the heap

    def __init__(self) -> None:
        super().__init__()
        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.malloc.restype = ctypes.c_void_p
        self._libc.malloc.argtypes = [ctypes.c_size_t]
        self._libc.free.argtypes = [ctypes.c_void_p]
        self.held: list[int] = []

    def forward(self, items):
        if any(item.data == HOLES for item in items):
            blocks = [self._libc.malloc(self.BLOCK) for _ in range(1600)]
            for address in blocks:
                ctypes.memset(address, 1, self.BLOCK)  # resident
            for address in blocks[::2]:
                self._libc.free(address)  # holes, none at the top: malloc keeps them
            self.held += blocks[1::2]
        return super().forward(items)

    def free(self) -> None:
        for address in self.held:
            self._libc.free(address)
        self.held = []


HOLES = "leave holes"


def test_a_quiet_replica_releases_after_its_requests():
    if release_host_memory() is None:
        unavailable("releasing free heap memory needs glibc")
    model = HoleyModel()
    try:
        with serve_in_thread(model, memory_release_idle_s=0.05) as live:
            response = httpx.post(f"{live.url}/v1/infer", json={"inputs": HOLES}, timeout=TIMEOUT)
            assert response.status_code == 200
            live.wait_for(
                lambda: live.sample("batchfit_host_heap_last_release_timestamp_seconds"),
                timeout_s=TIMEOUT,
            )
            # The holes the request's batch left, handed back once the replica went quiet.
            assert live.sample("batchfit_host_heap_released_bytes_total") >= 25 * 2**20
    finally:
        model.free()
