"""A lone input that cannot fit: refused before it runs where the limit kills, tried where an
allocation fails. The predicate, the probes' enforced limit, the budget and the batcher."""

import asyncio

import pytest

from batching import (
    AdaptiveConfig,
    AdaptiveSizer,
    BatchBudget,
    CompositeProbe,
    MemoryLimit,
    MemoryReading,
    NvmlProbe,
    OutOfMemory,
    PeakModel,
    TorchCudaProbe,
    limit_kills,
    refusal_room,
    refused_alone,
)
from tests.fakes import ScriptedModel, ScriptedProbe
from tests.test_probes import FakeCuda, FakeNvml

MiB = 2**20
TIMEOUT = 10


@pytest.mark.parametrize(
    ("source", "shared", "kills"),
    [
        ("cgroup", None, True),  # the kernel's OOM killer
        ("host", None, True),  # the OOM killer too, or a swapping host
        ("rlimit", None, False),  # an allocation fails
        ("flag", None, False),  # a budget, enforced by none at its value
        ("device", False, False),  # a CUDA OOM error
        ("device", None, False),  # sharing unknown
        ("device", True, True),  # a GPU other processes use
    ],
)
def test_which_limits_kill(source, shared, kills):
    assert limit_kills(MemoryLimit(source, 2**30, "x"), shared_device=shared) is kills


def test_the_refusal_room_is_the_room_under_the_enforced_limit_where_it_kills():
    cgroup = MemoryLimit("cgroup", 2**30, "/x")
    flag = MemoryLimit("flag", 2**29, "--memory-limit")
    # --memory-limit binds the budget; the cgroup, which kills, is the enforced limit.
    reading = MemoryReading(
        free_bytes=100 * MiB, limit=flag, enforced=cgroup, enforced_free_bytes=300 * MiB
    )
    assert refusal_room(reading) == 300 * MiB
    rlimit = MemoryLimit("rlimit", 2**30, "RLIMIT_AS")
    assert refusal_room(MemoryReading(enforced=rlimit, enforced_free_bytes=300 * MiB)) is None
    assert refusal_room(MemoryReading(free_bytes=1)) is None
    assert refusal_room(None) is None


class SharedNvml(FakeNvml):
    def __init__(self, processes):
        super().__init__()
        self.processes = processes

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [object()] * self.processes


@pytest.mark.parametrize(("processes", "room"), [(1, None), (2, 71 * 2**30)])
def test_a_gpu_shared_with_other_processes_refuses_ahead(processes, room):
    """The torch probe gives the device's room, NVML whether others use the device."""
    probe = CompositeProbe([TorchCudaProbe("cuda:0", cuda=FakeCuda()),
                            NvmlProbe(0, nvml=SharedNvml(processes))])  # fmt: skip
    reading = probe.read()
    assert reading.shared_device is (processes > 1)
    assert reading.enforced.source == "device"
    assert refusal_room(reading) == room


def sizer(headroom=0.1):
    prior = PeakModel(alpha=1.0, beta=0.0, alone_alpha=MiB, alone_beta=0.0)
    config = AdaptiveConfig(
        max_items=32, max_tokens=10_000, headroom_fraction=headroom, safety_factor=1.0
    )
    return AdaptiveSizer(prior, config)


def test_the_budget_holds_a_lone_input_to_the_room_less_headroom_not_to_the_ceiling():
    s = sizer()
    s.ceiling_bytes = 10 * MiB  # what warm-up proved: a lone input may pass it
    cgroup = MemoryLimit("cgroup", 2**30, "/x")
    budget = s.budget(ScriptedProbe(50 * MiB, cgroup, enforced=cgroup).read())
    assert budget.max_bytes == 10 * MiB
    assert budget.max_alone_bytes == pytest.approx(45 * MiB)
    rlimit = MemoryLimit("rlimit", 2**30, "RLIMIT_AS")
    assert s.budget(ScriptedProbe(50 * MiB, rlimit, enforced=rlimit).read()).max_alone_bytes is None


@pytest.mark.parametrize(
    ("cost", "max_alone", "refused"),
    [
        (45, 45 * MiB, None),  # exactly the room: it runs
        (46, 45 * MiB, 46 * MiB),  # one token over: refused, with its prediction
        (46, None, None),  # a limit that fails an allocation: tried
    ],
)
def test_refused_alone(cost, max_alone, refused):
    budget = BatchBudget(
        max_items=8, max_tokens=100, max_bytes=MiB, max_alone_bytes=max_alone,
        predict_bytes=lambda n, length: n * length * MiB,
    )  # fmt: skip
    assert refused_alone(cost, budget) == refused


def long_text(tokens):
    return " ".join(["w"] * (tokens - 2))  # ScriptedModel's cost: words + 2


async def test_a_lone_input_past_a_killing_room_is_refused_and_the_rest_run(harness_factory):
    """1 MiB per token alone, 40 MiB under the cgroup, 10% headroom: 36 tokens fit."""
    model = ScriptedModel(max_input_tokens=64)
    cgroup = MemoryLimit("cgroup", 2**30, "/x")
    probe = ScriptedProbe(40 * MiB, cgroup, enforced=cgroup)
    h = harness_factory(model=model, sizer=sizer(), probe=probe)
    pendings = h.submit([long_text(40), "a", "b c", long_text(36)])
    while not all(p.future.done() for p in pendings):
        await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    refused = pendings[0].future.exception()
    assert isinstance(refused, OutOfMemory)
    message = str(refused)
    assert "input 0 (40 tokens) cannot fit in memory even alone" in message
    assert f"{40 * MiB} bytes" in message  # predicted
    assert f"{int(0.9 * 40 * MiB)} bytes" in message  # available: the room less headroom
    assert "cgroup /x" in message
    assert all(p.future.exception() is None for p in pendings[1:])
    assert long_text(40) not in model.seen  # never ran
    assert long_text(36) in model.seen
    assert h.model_sample("batchfit_oom_refusals_total") == 1
    assert h.model_sample("batchfit_oom_events_total", {"outcome": "failed"}) == 0


async def test_where_an_allocation_fails_the_lone_input_is_tried(harness_factory):
    """The same input under the address-space limit runs, and the OOM path answers it."""
    model = ScriptedModel(max_input_tokens=64, oom_above_tokens=36)
    rlimit = MemoryLimit("rlimit", 2**30, "RLIMIT_AS")
    probe = ScriptedProbe(40 * MiB, rlimit, enforced=rlimit)
    h = harness_factory(model=model, sizer=sizer(), probe=probe)
    [pending] = h.submit([long_text(40)])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    with pytest.raises(OutOfMemory, match="even alone"):
        pending.future.result()
    assert model.batch_sizes == [1]  # it ran, and failed
    assert h.model_sample("batchfit_oom_refusals_total") == 0
    assert h.model_sample("batchfit_oom_events_total", {"outcome": "failed"}) == 1
