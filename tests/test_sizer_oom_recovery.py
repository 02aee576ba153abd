"""One out-of-memory error makes the sizer careful, but its evidence does not outlive later
evidence: a clean pass at least as large, more memory free than when it failed, or the clean
batches that bring the ceiling back (a transient OOM once refused a model's longer inputs
with 507 for good, with 180 GiB predicted against 18 GiB free)."""

import math

import pytest

from batching import (
    AdaptiveConfig,
    AdaptiveSizer,
    BatchOutcome,
    MemoryLimit,
    MemoryReading,
    PeakModel,
    largest_batch,
    refused_alone,
)

MiB = 2**20
PRIOR = PeakModel(alpha=1000.0, beta=10.0)
FREE = 100 * MiB  # free when the OOM happened
L = 40  # the lone input that ran out of memory
LONGER = (L, 100, 300)


def warm_sizer(**overrides):
    """Calibrated on exact peaks of the prior, as warm-up would, with 10% headroom."""
    config = {"max_items": 64, "max_tokens": 100_000, "headroom_fraction": 0.1,
              "safety_factor": 1.0, "recovery_fraction": 0.25, **overrides}  # fmt: skip
    s = AdaptiveSizer(PRIOR, AdaptiveConfig(**config))
    for n, length in [(64, 32), (16, 128), (64, 128), (1, 128)]:
        s.calibrate(BatchOutcome(n, length, 0.1, int(PRIOR.predict(n, length))))
    s.finish_warm_up()
    return s


def reading(free):
    """The room under a cgroup, which kills: a lone input predicted above it is refused."""
    cgroup = MemoryLimit("cgroup", 2**30, "/x")
    return MemoryReading(free_bytes=free, limit=cgroup, enforced=cgroup, enforced_free_bytes=free)


def oom_alone(s, length=L, free=FREE):
    s.budget(reading(free))  # the reading before the batch
    s.on_oom(1, length)


def refused(s, free=FREE, lengths=LONGER):
    budget = s.budget(reading(free))
    return [length for length in lengths if refused_alone(length, budget) is not None]


def test_before_any_oom_every_length_runs_alone():
    assert refused(warm_sizer()) == []


def test_right_after_an_oom_the_same_input_is_refused_while_no_more_memory_is_free():
    s = warm_sizer()
    oom_alone(s)
    assert refused(s) == list(LONGER)
    assert refused(s, free=FREE // 2) == list(LONGER)


@pytest.mark.parametrize(
    "clean",
    [(1, L), (1, 100), (4, L), (8, 300)],
    ids=["same shape", "longer", "more items", "larger in both"],
)
def test_a_clean_pass_at_least_as_large_as_the_oom_lifts_its_refusals(clean):
    s = warm_sizer()
    oom_alone(s)
    s.observe(BatchOutcome(*clean, elapsed_s=0.01))
    assert refused(s) == []
    assert s.model == warm_sizer().model  # as if the OOM had never been


@pytest.mark.parametrize(
    "clean", [(1, L - 1), (64, 32)], ids=["one token shorter", "many short items"]
)
def test_a_smaller_clean_pass_does_not_lift_them(clean):
    s = warm_sizer()
    oom_alone(s)
    s.observe(BatchOutcome(*clean, elapsed_s=0.01))
    assert refused(s) == list(LONGER)


@pytest.mark.parametrize(
    ("free_now", "expected"),
    [
        (FREE // 2, list(LONGER)),
        (FREE, list(LONGER)),
        (FREE + MiB, []),
        (2 * FREE, []),
        (180 * 2**30, []),
    ],
    ids=["half", "the same", "1 MiB more", "twice", "far more"],
)
def test_an_oom_refuses_alone_only_while_no_more_memory_is_free_than_when_it_happened(
    free_now, expected
):
    s = warm_sizer()
    oom_alone(s)
    assert refused(s, free=free_now) == expected
    # Neither reading forgets the OOM: with less free again, it refuses again.
    assert refused(s) == list(LONGER)


def test_with_more_memory_free_the_model_predicts_as_before_the_oom():
    s, before = warm_sizer(), warm_sizer()
    oom_alone(s)
    budget, clean = s.budget(reading(2 * FREE)), before.budget(reading(2 * FREE))
    for shape in [(1, L), (1, 300), (8, 128)]:
        assert budget.predict_bytes(*shape) == clean.predict_bytes(*shape)


def test_the_evidence_lapses_after_the_clean_batches_that_restore_the_ceiling():
    """``recovery_fraction`` 0.25: four clean batches take the ceiling from nothing back to
    what warm-up proved; after as many, of any shape, the OOM no longer refuses."""
    s = warm_sizer()
    oom_alone(s)
    for _ in range(3):
        s.observe(BatchOutcome(1, 10, 0.01))
    assert refused(s) == list(LONGER)
    s.observe(BatchOutcome(1, 10, 0.01))
    assert refused(s) == []
    assert s.ceiling_bytes == s.proven_bytes


def test_after_a_batch_oom_the_same_batch_is_not_planned_again_even_with_more_free():
    s = warm_sizer(oom_decrease=0.5)
    s.budget(reading(FREE))
    s.on_oom(64, 128)
    for free in (FREE, 2 * FREE):
        budget = s.budget(reading(free))
        assert not budget.fits(64, 128)
        assert 0 < largest_batch(budget, 128) < 64


def test_after_a_batch_oom_a_clean_batch_as_large_restores_the_prediction_and_the_ceiling_climbs():
    s, before = warm_sizer(oom_decrease=0.5), warm_sizer()
    s.budget(reading(FREE))
    s.on_oom(64, 128)
    assert s.budget(reading(FREE)).predict_bytes(64, 128) >= FREE
    s.observe(BatchOutcome(64, 128, 0.1))
    budget = s.budget(reading(FREE))
    assert budget.predict_bytes(64, 128) == before.budget(reading(FREE)).predict_bytes(64, 128)
    assert s.ceiling_bytes == pytest.approx(s.proven_bytes * 0.75)


def test_peaks_measured_while_an_oom_weighed_are_kept_for_after_it():
    """A clean pass's peak above the measured line corrects the model even where the OOM
    had lifted the prediction over it, so nothing learnt meanwhile is lost when it lapses."""
    s = warm_sizer()
    oom_alone(s)
    peak = int(3 * s.prior.predict(1, 20))
    assert peak < s.model.predict(1, 20)  # under the line the OOM lifted
    s.observe(BatchOutcome(1, 20, 0.01, peak))
    s.observe(BatchOutcome(1, L, 0.01))  # the OOM lapses
    assert s.model.predict(1, 20) >= peak * (1 - 1e-9)
    assert s.model.predict(1, 300) < FREE


def test_without_warm_up_the_evidence_still_lapses():
    s = AdaptiveSizer(PRIOR, AdaptiveConfig(max_items=64, max_tokens=100_000))
    oom_alone(s)
    assert refused(s) == list(LONGER)
    for _ in range(math.ceil(1 / s.config.recovery_fraction)):
        s.observe(BatchOutcome(1, 10, 0.01))
    assert refused(s) == []
