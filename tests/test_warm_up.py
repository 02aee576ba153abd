"""Warm-up under a memory limit, over a scripted model and probe."""

import pytest

from batching import AdaptiveConfig, AdaptiveSizer, MemoryLimit, PeakModel
from server import Settings
from server.runtime.runtime import Runtime
from tests.fakes import ScriptedModel, ScriptedProbe


async def warm_up_sizes(registry, limit, *, max_batch_size=1024):
    """Batch sizes of start-up: 1 MiB free at 1 KiB per token fits 32 x 32 and 16 x 64."""
    model = ScriptedModel(max_input_tokens=64)
    config = AdaptiveConfig(
        max_items=max_batch_size, max_tokens=10**6, headroom_fraction=0, safety_factor=1.0
    )
    settings = Settings(max_batch_size=max_batch_size, max_batch_tokens=10**6)
    runtime = Runtime(
        settings, registry=registry, model=model,
        sizer=AdaptiveSizer(PeakModel(alpha=1024, beta=0), config),
        probe=ScriptedProbe(2**20, limit),
    )  # fmt: skip
    await runtime.start()
    try:
        assert runtime.startup_error is None
        return model.batch_sizes
    finally:
        await runtime.stop()


@pytest.mark.parametrize(
    ("source", "sizes"),
    [
        # After the pass that starts the threads, the first length always runs a quarter
        # batch first (two sizes tell a pass's fixed cost from its per-token cost), and the
        # ladder ends with one input alone at the longest length. The kernel kills past
        # these limits, and nothing fails at --memory-limit's value: a quarter of each
        # length's batch runs first.
        ("cgroup", [1, 8, 32, 4, 16, 1]),
        ("host", [1, 8, 32, 4, 16, 1]),
        ("flag", [1, 8, 32, 4, 16, 1]),
        # This fails an allocation instead, which warm-up already handles by halving.
        ("rlimit", [1, 8, 32, 16, 1]),
    ],
)
async def test_where_memory_sets_the_warm_up_batch_a_killing_limit_gets_a_scout(
    registry, source, sizes
):
    assert await warm_up_sizes(registry, MemoryLimit(source, 2**21, "x")) == sizes


async def test_no_scout_where_a_cap_sets_the_warm_up_batch(registry):
    limit = MemoryLimit("cgroup", 2**21, "/x")
    assert await warm_up_sizes(registry, limit, max_batch_size=8) == [1, 2, 8, 8, 1]


async def test_memory_settles_before_every_calibration_batch_and_no_served_one(registry):
    """A calibration batch reusing free blocks the allocator still holds would read a peak
    below its real footprint, and every batch planned from it would overshoot."""
    model = ScriptedModel(max_input_tokens=64)
    probe = ScriptedProbe(2**20, MemoryLimit("rlimit", 2**21, "RLIMIT_AS"), model=model)
    config = AdaptiveConfig(max_items=1024, max_tokens=10**6, headroom_fraction=0)
    runtime = Runtime(
        Settings(max_batch_size=1024, max_batch_tokens=10**6), registry=registry, model=model,
        sizer=AdaptiveSizer(PeakModel(alpha=1024, beta=0), config), probe=probe,
    )  # fmt: skip
    await runtime.start()
    try:
        assert runtime.startup_error is None
        calibrations = len(model.batch_sizes) - 1  # after the one-item pass that starts threads
        assert probe.settled_before == list(range(1, 1 + calibrations)), probe.settled_before
        await runtime.infer(["served"], truncate=True, timeout_s=10, request_id="r")
        assert len(probe.settled_before) == calibrations
    finally:
        await runtime.stop()


async def test_every_model_is_warmed_up_and_shows_its_proven_ceiling(registry):
    """Each model has its own sizer; one left without a warm-up would have no ceiling and size
    its batches by the prior alone."""
    models = {"a": ScriptedModel(max_input_tokens=64), "b": ScriptedModel(max_input_tokens=64)}
    settings = Settings(model=("a=x", "b=y"), max_batch_size=1024, max_batch_tokens=10**6)
    runtime = Runtime(settings, registry=registry, models=models, probe=ScriptedProbe(2**20))
    await runtime.start()
    try:
        assert runtime.startup_error is None
        for name, model in models.items():
            sizer = runtime.slots[name].sizer
            assert sizer.proven_bytes is not None and sizer.ceiling_bytes == sizer.proven_bytes
            assert len(model.batch_sizes) > 1  # the first forward, then its warm-up batches
            ceiling = registry.get_sample_value("batchfit_batch_ceiling_bytes", {"model": name})
            assert ceiling == sizer.proven_bytes > 0
    finally:
        await runtime.stop()
