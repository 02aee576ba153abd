"""The GPU storm's checks, on the CPU: a sizer given a device reading is judged against the
room the check measures itself (NVML before the ballast, less the ballast's bytes)."""

from __future__ import annotations

import dataclasses

import pytest

from batching import AdaptiveConfig, AdaptiveSizer, TorchCudaProbe, prior_peak_model
from scripts.gpu_storm import (
    BUDGET_CHECK,
    HEADROOM,
    NO_OOM_CHECK,
    StormPlan,
    budget_slack_bytes,
    budget_within_room,
    storm_checks,
)
from tests.test_probes import FakeCuda

GIB, MIB = 2**30, 2**20
CUDA_PLAN = StormPlan("cuda", "adaptive", "auto", 1024, 128, inputs_per_request=8)


class DoublingSizer(AdaptiveSizer):
    """A sizer that budgets twice what the memory it reads allows."""

    def budget(self, reading=None):
        budget = super().budget(reading)
        return dataclasses.replace(budget, max_bytes=2 * budget.max_bytes)


def device_reading():
    """What a replica beside the ballast reads: 2 GiB were free before it started (the room the
    check measured); its CUDA context and weights took 600 MiB of them, and torch holds 100 MiB
    of cache it may reuse."""
    cuda = FakeCuda()
    cuda.total = 141 * GIB
    cuda.allocated, cuda.reserved = 60 * MIB, 160 * MIB
    cuda.free = 2 * GIB - 500 * MIB - cuda.reserved
    return TorchCudaProbe("cuda:0", cuda=cuda).read()


def figures(budget_bytes, **changes):
    return {
        "failed_requests": {}, "min_cosine_vs_cpu_float32": 0.9995, "ready_after": True,
        "replica_dtype": "float16", "ballast_seen_by_nvml": True, "grow_back": {"ok": True},
        "oom_splits": 0.0, "oom_failed_items": 0.0, "budget_before_bytes": budget_bytes,
        "independent_room_bytes": 2 * GIB,
    } | changes  # fmt: skip


@pytest.mark.parametrize(("sizer_class", "passes"), [(AdaptiveSizer, True),
                                                     (DoublingSizer, False)])  # fmt: skip
def test_a_sizer_that_doubles_its_budget_on_cuda_fails_the_storm(sizer_class, passes):
    prior = prior_peak_model(hidden_size=384, intermediate_size=1536, num_heads=12,
                             element_bytes=2)  # fmt: skip
    config = AdaptiveConfig(4096, 4096 * 256, headroom_fraction=HEADROOM)
    budget = sizer_class(prior, config).budget(device_reading()).max_bytes
    checks = storm_checks(CUDA_PLAN, figures(budget))
    assert checks[BUDGET_CHECK] is passes, (budget / MIB, checks)
    assert all(ok for name, ok in checks.items() if name != BUDGET_CHECK)


def test_any_oom_fails_the_adaptive_storm_and_none_fails_the_fixed_one():
    budget = 1.5 * GIB
    assert not storm_checks(CUDA_PLAN, figures(budget, oom_splits=3.0))[NO_OOM_CHECK]
    assert not storm_checks(CUDA_PLAN, figures(budget, oom_failed_items=1.0))[NO_OOM_CHECK]
    fixed = StormPlan("cuda", "fixed", "float32", 1024, 128, inputs_per_request=8)
    checks = storm_checks(fixed, figures(None, replica_dtype="float32"))
    assert not checks["real OOMs split (fixed caps)"] and BUDGET_CHECK not in checks


def test_the_room_must_be_measured_and_nvml_must_see_the_ballast():
    assert not budget_within_room(GIB, None, 0) and not budget_within_room(None, GIB, 0)
    checks = storm_checks(CUDA_PLAN, figures(GIB, ballast_seen_by_nvml=False))
    assert not checks["NVML (read by the check) sees the ballast"]
    assert budget_slack_bytes(CUDA_PLAN) == 64 * MIB
    assert budget_within_room(0.85 * GIB + 60 * MIB, GIB, 64 * MIB)
    assert not budget_within_room(0.85 * GIB + 70 * MIB, GIB, 64 * MIB)


def test_on_the_cpu_the_room_is_the_limit_less_the_resident_memory_at_ready():
    plan = StormPlan("cpu", "adaptive", "auto", 24, 8, inputs_per_request=4,
                     memory_limit=str(640 * MIB))  # fmt: skip
    assert budget_slack_bytes(plan) == pytest.approx(6.4 * MIB)
    # The dry run: 43 MB left under the limit after warm-up; the replica budgeted 36.6 MB.
    cpu = figures(36.6e6, replica_dtype="float32", independent_room_bytes=43.3e6)
    assert storm_checks(plan, cpu)[BUDGET_CHECK]
    assert not storm_checks(plan, cpu | {"budget_before_bytes": 2 * 36.6e6})[BUDGET_CHECK]
