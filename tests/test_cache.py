"""The output cache: the store and its bound, the key, and (over a scripted model, in
process) hits, partial hits and one computation per input in flight."""

import asyncio
import contextlib
import threading

import numpy as np
import pytest

from batching import Pending, QueueFull, RequestQueue
from models import Item, Tokens
from server import Settings, create_app
from server.cache import ENTRY_OVERHEAD_BYTES, InputCache, OutputStore, cache_key, stored_value
from server.errors import ApiError
from server.runtime import ClientDisconnected
from tests.fakes import ScriptedModel

TIMEOUT = 10


# --- the store ---


def _key(i: int, model: str = "m"):
    return (model, 0, b"T" + i.to_bytes(4, "little"))


def test_the_store_evicts_the_least_recently_used_and_never_exceeds_its_bound():
    evicted: list[str] = []
    value = stored_value(np.zeros(96, dtype=np.float32))
    entry = 5 + len("m") + value.nbytes + 112 + ENTRY_OVERHEAD_BYTES  # roughly one entry
    store = OutputStore(10 * entry, on_evict=evicted.append)
    for i in range(5):
        assert store.put(_key(i), value)
    found, stored = store.get(_key(0))  # 0 becomes the most recently used
    assert found and np.array_equal(stored, value)
    first_eviction = None
    for i in range(5, 40):
        assert store.put(_key(i), value)
        assert 0 < store.bytes <= store.max_bytes
        assert store.bytes == sum(store.bytes_by_model.values())
        if evicted and first_eviction is None:
            first_eviction = i
            # 1 is the least recently used: 0 was read after 1-4 were stored.
            assert store.get(_key(1)) == (False, None)
            assert store.get(_key(0))[0]
    assert first_eviction is not None
    assert len(evicted) == 40 - len(store) and set(evicted) == {"m"}
    assert store.get(_key(39))[0] and not store.get(_key(0))[0]


def test_a_value_larger_than_the_bound_is_not_stored():
    store = OutputStore(1000)
    assert not store.put(_key(1), np.zeros(1000, dtype=np.float32))
    assert store.bytes == 0 and len(store) == 0


def test_a_stored_array_is_its_own_read_only_copy():
    batch = np.arange(3 * 4096, dtype=np.float32).reshape(3, 4096)
    store = OutputStore(1 << 20)
    assert store.put(_key(0), batch[1])  # an answer: a row of its batch's outputs
    assert store.bytes >= batch[1].nbytes + ENTRY_OVERHEAD_BYTES  # the copy's, counted
    for row in (stored_value(batch[1]), store.get(_key(0))[1]):
        assert np.array_equal(row, batch[1])
        assert not np.shares_memory(row, batch) and row.base is None  # the batch can be freed
        with pytest.raises(ValueError):
            row[0] = 5.0


# --- the key ---


def _item(ids, type_ids=None, prompt_length=0):
    return Item(data=Tokens(list(ids), type_ids, prompt_length), cost=len(ids))


def test_every_part_of_what_the_model_reads_is_in_the_key():
    base = cache_key("m", _item([101, 7, 8, 102]), None)
    assert base == cache_key("m", _item([101, 7, 8, 102]), None)
    variants = [
        cache_key("other", _item([101, 7, 8, 102]), None),  # the model
        cache_key("m", _item([101, 7, 9, 102]), None),  # a token
        cache_key("m", _item([101, 7, 8]), None),  # truncated
        cache_key("m", _item([7, 8, 102]), None),  # truncated on the other side
        cache_key("m", _item([101, 7, 8, 102], [0, 0, 1, 1]), None),  # a pair's segments
        cache_key("m", _item([101, 7, 8, 102], [0, 1, 1, 1]), None),
        cache_key("m", _item([101, 7, 8, 102], prompt_length=2), None),  # a pooled-out prompt
        cache_key("m", _item([101, 7, 8, 102]), 128),  # dimensions
        cache_key("m", _item([2**33, 7]), None),  # ids beyond 32 bits still encode exactly
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_item_data_of_an_unknown_kind_is_never_cached():
    assert cache_key("m", Item(data=[1, 2, 3], cost=3), None) is None
    assert cache_key("m", Item(data="text", cost=3), None) is not None


# --- the table of computations in flight ---


async def test_an_equal_input_arriving_as_its_computation_finishes_joins_it(registry):
    """Between the batcher setting a computation's result and the loop running its done
    callback, an equal input still joins it: it is neither computed again nor lost."""
    loop = asyncio.get_running_loop()
    cache = InputCache(registry, max_bytes=1 << 20, deduplicate=True, queue=RequestQueue(8))
    cache.add_model("m")

    def admit(ids=(101, 7, 102)):
        return cache.admit(
            loop, "m", [_item(ids)], dimensions=None, priority=0, deadline_s=1e9,
            make_pending=lambda item, index: Pending(item, loop.create_future(), 0.0, 1e9),
            finish=lambda output: output,
        )  # fmt: skip

    first = admit()
    first.queued[0].future.set_result(np.ones(4, dtype=np.float32))  # its callback not run yet
    second = admit()
    assert second.queued == []  # joined, not queued again
    results = await asyncio.gather(*first.futures, *second.futures)
    assert all(np.array_equal(result, np.ones(4)) for result in results)
    assert cache.in_flight() == 0
    third = admit()  # now a hit from the store
    assert third.queued == [] and third.hits == 1
    # A cancelled computation (its last waiter gone) is not joined: the newcomer runs anew.
    cancelled = admit((101, 8, 102))
    assert cache.release(cancelled) == cancelled.queued
    again = admit((101, 8, 102))
    assert len(again.queued) == 1 and not again.futures[0].done()
    again.queued[0].future.set_result(np.zeros(4, dtype=np.float32))
    assert np.array_equal(await again.futures[0], np.zeros(4))


@pytest.mark.parametrize(
    ("max_bytes", "deduplicate", "dimensions", "direct"),
    [(0, False, None, True), (1 << 20, False, None, False), (0, True, None, False),
     (0, False, 2, False)],
    ids=["off", "stored", "deduplicated", "reshaped"],
)  # fmt: skip
async def test_an_input_neither_stored_shared_nor_reshaped_is_awaited_without_a_flight(
    registry, max_bytes, deduplicate, dimensions, direct
):
    """The request awaits the computation's own future: nothing between the batcher's result
    and the request (one turn of the loop fewer); its end still cancels what did not run."""
    loop = asyncio.get_running_loop()
    cache = InputCache(registry, max_bytes=max_bytes, deduplicate=deduplicate,
                       queue=RequestQueue(8))  # fmt: skip
    cache.add_model("m")
    finish = None if dimensions is None else (lambda output: output[:dimensions])
    admission = cache.admit(
        loop, "m", [_item((101, 7, 102)), _item((101, 8, 102))], dimensions=dimensions,
        priority=0, deadline_s=1e9,
        make_pending=lambda item, index: Pending(item, loop.create_future(), 0.0, 1e9),
        finish=finish,
    )  # fmt: skip
    first, second = admission.queued
    assert (admission.futures == [first.future, second.future]) is direct
    assert admission.pendings == [first, second]
    first.future.set_result(np.ones(4, dtype=np.float32))
    assert len(await admission.futures[0]) == (4 if dimensions is None else dimensions)
    assert cache.release(admission) == [second]  # no requester left: it never runs
    assert second.future.cancelled() and not first.future.cancelled()
    assert cache.release(admission) == []


# --- in a replica over a scripted model ---


@contextlib.asynccontextmanager
async def replica(model, registry, **settings):
    app = create_app(Settings(sizer="fixed", **settings), model=model, registry=registry)
    async with app.router.lifespan_context(app):
        runtime = app.state.runtime
        async with asyncio.timeout(TIMEOUT):
            while not runtime.ready:
                await asyncio.sleep(0.01)
        yield runtime


def infer(runtime, inputs, **options):
    options.setdefault("timeout_s", 30.0)
    return runtime.infer(inputs, truncate=True, request_id="t", **options)


def counter(registry, name, model="scripted"):
    return registry.get_sample_value(name, {"model": model}) or 0


class Gone:
    """A client watch the test fires: that client disconnected."""

    def __init__(self) -> None:
        self._callbacks = []

    def subscribe(self, callback):
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def fire(self) -> None:
        for callback in list(self._callbacks):
            callback()


_blockers = iter(range(10**6))


async def _model_busy(runtime, model, gate):
    """Hold the model thread on a batch of a new input (a repeated one would be a hit), so
    what follows waits in the queue."""
    gate.clear()
    model.entered.clear()
    blocker = asyncio.ensure_future(infer(runtime, [f"blocker {next(_blockers)}"]))
    assert await asyncio.to_thread(model.entered.wait, TIMEOUT)
    return blocker


async def _queued(runtime, count):
    async with asyncio.timeout(TIMEOUT):  # a guard against hangs
        while len(runtime.queue) != count:
            await asyncio.sleep(0.001)


async def test_partial_hits_keep_the_order_and_only_the_misses_run(registry):
    model = ScriptedModel()
    async with replica(model, registry) as runtime:
        first, _ = await infer(runtime, ["a", "b"])
        model.seen.clear()
        second, tokens = await infer(runtime, ["c", "a", "d", "b"])
        again, _ = await infer(runtime, ["b", "a"])
    assert first == ["out:a", "out:b"]
    assert second == ["out:c", "out:a", "out:d", "out:b"] and again == ["out:b", "out:a"]
    assert model.seen == ["c", "d"]  # the hits never reached the model
    assert tokens == 4 * 3  # usage still counts every input's tokens
    assert counter(registry, "batchfit_cache_hits_total") == 4
    assert counter(registry, "batchfit_cache_misses_total") == 4


async def test_inputs_repeated_in_flight_run_once(registry):
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    async with replica(model, registry) as runtime:
        blocker = await _model_busy(runtime, model, gate)
        requests = [asyncio.ensure_future(infer(runtime, ["same", "same"])) for _ in range(32)]
        await _queued(runtime, 1)  # 64 inputs, one computation
        gate.set()
        answers = await asyncio.gather(*requests)
        await blocker
    assert all(outputs == ["out:same", "out:same"] for outputs, _ in answers)
    assert model.seen.count("same") == 1
    assert counter(registry, "batchfit_deduplicated_inputs_total") == 63


async def test_a_first_requester_that_goes_away_does_not_cancel_the_others(registry):
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    async with replica(model, registry) as runtime:
        # Queued: the first requester leaves while its input waits for the model.
        blocker = await _model_busy(runtime, model, gate)
        first_client = Gone()
        first = asyncio.ensure_future(infer(runtime, ["x"], client=first_client))
        second = asyncio.ensure_future(infer(runtime, ["x"]))
        await _queued(runtime, 1)
        first_client.fire()
        with pytest.raises(ClientDisconnected):
            await first
        assert len(runtime.queue) == 1  # the shared computation stays queued for the second
        gate.set()
        assert await second == (["out:x"], 3)
        await blocker
        # Running: the first requester leaves while the shared batch is on the model.
        gate.clear()
        model.entered.clear()
        first_client = Gone()
        first = asyncio.ensure_future(infer(runtime, ["y"], client=first_client))
        assert await asyncio.to_thread(model.entered.wait, TIMEOUT)
        second = asyncio.ensure_future(infer(runtime, ["y"]))
        await asyncio.sleep(0)
        first_client.fire()
        with pytest.raises(ClientDisconnected):
            await first
        gate.set()
        assert await second == (["out:y"], 3)
    assert model.seen.count("x") == 1 and model.seen.count("y") == 1


async def test_a_deadline_passing_for_one_requester_does_not_fail_the_rest(registry):
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    async with replica(model, registry) as runtime:
        blocker = await _model_busy(runtime, model, gate)
        patient = asyncio.ensure_future(infer(runtime, ["x"], timeout_s=30.0))
        await _queued(runtime, 1)
        with pytest.raises(ApiError, match="deadline") as late:
            await infer(runtime, ["x"], timeout_s=0.05)
        assert late.value.status == 504
        gate.set()
        assert await patient == (["out:x"], 3)
        await blocker
        # The other way round: the first requester's deadline is the short one.
        blocker = await _model_busy(runtime, model, gate)
        short = asyncio.ensure_future(infer(runtime, ["z"], timeout_s=0.05))
        await _queued(runtime, 1)
        patient = asyncio.ensure_future(infer(runtime, ["z"], timeout_s=30.0))
        with pytest.raises(ApiError, match="deadline"):
            await short
        gate.set()
        assert await patient == (["out:z"], 3)
        await blocker
    assert model.seen.count("x") == 1 and model.seen.count("z") == 1


async def test_no_requester_left_means_the_input_never_runs(registry):
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    async with replica(model, registry) as runtime:
        blocker = await _model_busy(runtime, model, gate)
        clients = [Gone(), Gone()]
        waiting = [asyncio.ensure_future(infer(runtime, ["x"], client=c)) for c in clients]
        await _queued(runtime, 1)
        for client in clients:
            client.fire()
        for request in waiting:
            with pytest.raises(ClientDisconnected):
                await request
        assert len(runtime.queue) == 0
        gate.set()
        await blocker
        assert runtime.inputs.in_flight() == 0
    assert "x" not in model.seen


async def test_a_request_the_full_queue_refuses_leaves_nothing_waiting_behind(registry):
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    async with replica(model, registry, max_queue_items=2, max_inputs_per_request=2) as runtime:
        blocker = await _model_busy(runtime, model, gate)
        held = asyncio.ensure_future(infer(runtime, ["x"]))
        await _queued(runtime, 1)
        with pytest.raises(QueueFull):  # 1 + 2 items: over the queue's 2
            await infer(runtime, ["y", "z"])
        # The refused request's computations were cancelled (they leave the table as the loop
        # turns) and its wait ended: the same inputs run once there is room.
        await asyncio.sleep(0)
        assert runtime.inputs.in_flight() == 2  # the blocker's and "x"
        assert runtime.work.active_requests == 2
        gate.set()
        await blocker
        assert await held == (["out:x"], 3)
        assert await infer(runtime, ["y", "z"]) == (["out:y", "out:z"], 6)
        assert runtime.inputs.in_flight() == 0
        assert runtime.work.active_requests == 0


async def test_a_joiner_of_higher_priority_raises_the_shared_computation(registry):
    gate = threading.Event()
    gate.set()
    model = ScriptedModel(gate=gate)
    async with replica(model, registry, max_batch_size=1) as runtime:
        blocker = await _model_busy(runtime, model, gate)
        older = asyncio.ensure_future(infer(runtime, ["older"]))
        low = asyncio.ensure_future(infer(runtime, ["x"]))
        await _queued(runtime, 2)
        urgent = asyncio.ensure_future(infer(runtime, ["x"], priority=5))
        await asyncio.sleep(0)
        model.seen.clear()
        gate.set()
        await asyncio.gather(blocker, older, low, urgent)
    assert model.seen[1:] == ["x", "older"]


async def test_with_the_cache_off_every_input_runs(registry):
    model = ScriptedModel()
    async with replica(model, registry, cache_bytes=0, deduplicate=False) as runtime:
        await infer(runtime, ["a", "a"])
        await infer(runtime, ["a"])
    assert model.seen.count("a") == 3
    assert counter(registry, "batchfit_cache_hits_total") == 0
    assert counter(registry, "batchfit_cache_bytes") == 0


async def test_the_cache_bytes_stay_under_the_bound_while_it_evicts(registry):
    model = ScriptedModel()
    bound = 16 * 1024
    async with replica(model, registry, cache_bytes=bound) as runtime:
        for start in range(0, 400, 20):
            await infer(runtime, [f"text number {i}" for i in range(start, start + 20)])
            held = counter(registry, "batchfit_cache_bytes")
            assert 0 < held <= bound
        assert counter(registry, "batchfit_cache_evictions_total") > 0
        assert runtime.inputs.store.bytes == held
        # The newest inputs are still there; the oldest were evicted.
        model.seen.clear()
        await infer(runtime, ["text number 399", "text number 0"])
    assert model.seen == ["text number 0"]


# --- the default bound ---


def test_the_default_bound_is_a_twentieth_of_the_host_memory_the_replica_may_use(tmp_path):
    from server.cache import default_cache_bytes, host_memory_bytes

    (tmp_path / "meminfo").write_text("MemTotal:       25165824 kB\nMemFree: 1 kB\n")
    assert host_memory_bytes(None, on_host=True, proc=tmp_path) == 24 * 2**30
    assert host_memory_bytes(2**30, on_host=True, proc=tmp_path) == 2**30  # --memory-limit
    assert host_memory_bytes(2**30, on_host=False, proc=tmp_path) == 24 * 2**30  # on a GPU
    assert default_cache_bytes(24 * 2**30) == 1228 * 2**20  # 5%, in whole MiB
    assert default_cache_bytes(None) == 0


def test_a_replica_s_default_bound_follows_the_rule(registry):
    from server.cache import default_cache_bytes, host_memory_bytes

    async def check():
        async with replica(ScriptedModel(), registry) as runtime:
            return runtime.inputs.max_bytes

    expected = default_cache_bytes(host_memory_bytes(None, on_host=True))
    assert expected > 0 and asyncio.run(check()) == expected
