import math

import pytest

from batching import (
    AdaptiveConfig,
    AdaptiveSizer,
    BatchOutcome,
    MemoryReading,
    PeakModel,
    fit_envelope,
    largest_batch,
    prior_peak_model,
)

PRIOR = PeakModel(alpha=1000.0, beta=10.0)
MiB = 2**20


def sizer(**overrides):
    config = {"max_items": 64, "max_tokens": 100_000, "headroom_fraction": 0.1,
              "safety_factor": 1.0, **overrides}  # fmt: skip
    return AdaptiveSizer(PRIOR, AdaptiveConfig(**config))


def reading(free):
    return MemoryReading(free_bytes=free)


def test_prior_from_the_config():
    """all-MiniLM-L6-v2's shape, under eager attention (the default where unknown)."""
    prior = prior_peak_model(hidden_size=384, intermediate_size=1536, num_heads=12, element_bytes=4)
    # Hidden states, query/key/value (12 heads of 32, each), the feed-forward's two.
    assert prior.alpha == 4 * (8 * 384 + 3 * 384 + 2 * 1536)
    # Eager: every head's scores (three copies) and the float mask, alone or not.
    assert prior.beta == prior.alone_beta == 4 * 3 * 12 + 4
    assert prior.predict(2, 10) == 2 * 10 * (prior.alpha + prior.beta * 10)


QWEN3_0_6B = {
    "hidden_size": 1024, "intermediate_size": 3072, "num_heads": 16, "num_kv_heads": 8,
    "head_dim": 128, "element_bytes": 2, "gated_mlp": True,
}  # fmt: skip


@pytest.mark.parametrize(
    ("attention", "sliding_window", "beta", "alone_beta"),
    [
        ("eager", None, 2 * 3 * 16 + 2, 2 * 3 * 16 + 2),
        # sdpa: a padded batch's mask (a byte, and its float copy); one input alone, none.
        ("sdpa", None, 1 + 2, 0.0),
        # A sliding window's mask is built from int64 distances, alone too.
        ("sdpa", 4096, 1 + 2 + 16 + 3, 16 + 3),
        ("flash_attention_2", None, 0.0, 0.0),
    ],
)
def test_the_prior_follows_the_attention_in_use(attention, sliding_window, beta, alone_beta):
    prior = prior_peak_model(**QWEN3_0_6B, attention=attention, sliding_window=sliding_window)
    assert (prior.beta, prior.alone_beta) == (beta, alone_beta)
    # Grouped-query attention: 16 query and 2 x 8 key/value heads of 128; a gated
    # feed-forward holds three intermediate activations.
    assert prior.alpha == prior.alone_alpha == 2 * (8 * 1024 + (16 + 16) * 128 + 3 * 3072)


def test_a_lone_input_has_its_own_line():
    model = PeakModel(alpha=100.0, beta=5.0, alone_alpha=80.0, alone_beta=0.0, fixed_bytes=7.0)
    assert model.predict(1, 1000) == 7 + 1000 * 80
    assert model.predict(2, 1000) == 7 + 2 * 1000 * (100 + 5 * 1000)


@pytest.mark.parametrize(
    ("true_model", "shapes"),
    [
        (PeakModel(500.0, 2.0), [(8, 32), (4, 128), (1, 256), (16, 64)]),
        (PeakModel(800.0, 0.0), [(32, 32), (16, 256)]),
    ],
)
def test_fit_recovers_alpha_and_beta_from_exact_peaks(true_model, shapes):
    samples = [(n, length, true_model.predict(n, length)) for n, length in shapes]
    fitted = fit_envelope(PRIOR, samples)
    assert fitted.alpha == pytest.approx(true_model.alpha, rel=1e-6)
    assert fitted.beta == pytest.approx(true_model.beta, rel=1e-6, abs=1e-9)


def test_fit_is_an_upper_envelope_of_noisy_samples():
    samples = [(8, 32, 300_000.0), (8, 32, 200_000.0), (4, 128, 700_000.0), (2, 256, 600_000.0)]
    fitted = fit_envelope(PRIOR, samples)
    for n, length, peak in samples:
        assert fitted.predict(n, length) >= peak * (1 - 1e-9)


def test_fit_with_one_length_scales_the_prior():
    fitted = fit_envelope(PRIOR, [(10, 50, 2 * PRIOR.predict(10, 50))])
    assert fitted.line(10) == (2 * PRIOR.alpha, 2 * PRIOR.beta)
    # No sample of a lone input: its line is the prior's, scaled as the batch line was.
    assert fitted.line(1) == (2 * PRIOR.alpha, 2 * PRIOR.beta)


SDPA = PeakModel(alpha=1000.0, beta=5.0, alone_alpha=1000.0, alone_beta=0.0)


def test_lone_inputs_fit_their_own_line_and_batches_theirs():
    """Under sdpa a lone input holds no mask: measured alone, its line has no L^2 term,
    while padded batches keep theirs."""
    truth = PeakModel(alpha=600.0, beta=4.0, alone_alpha=500.0, alone_beta=0.0)
    shapes = [(64, 32), (16, 128), (4, 512), (1, 512), (1, 2048)]
    fitted = fit_envelope(SDPA, [(n, length, truth.predict(n, length)) for n, length in shapes])
    assert fitted.line(4) == pytest.approx((600.0, 4.0))
    assert fitted.line(1) == pytest.approx((500.0, 0.0), abs=1e-6)
    # Extrapolated far past the longest sample: what a lone 32k input is predicted to need.
    assert fitted.predict(1, 32768) == pytest.approx(truth.predict(1, 32768))


def test_the_fixed_cost_of_a_pass_is_told_from_its_per_token_cost():
    """Two batch sizes at one length: the constant a pass adds whatever its size."""
    truth = PeakModel(alpha=600.0, beta=4.0, fixed_bytes=2 * MiB)
    shapes = [(32, 32), (128, 32), (32, 128), (8, 512)]
    fitted = fit_envelope(SDPA, [(n, length, truth.predict(n, length)) for n, length in shapes])
    assert fitted.fixed_bytes == pytest.approx(2 * MiB, rel=1e-6)
    assert fitted.line(8) == pytest.approx((600.0, 4.0), rel=1e-6)
    # One token count only: the constant cannot be told apart and stays 0.
    same = fit_envelope(SDPA, [(n, length, truth.predict(n, length)) for n, length in
                               [(128, 32), (32, 128), (8, 512)]])  # fmt: skip
    assert same.fixed_bytes == 0


def test_the_slope_that_predicts_long_inputs_comes_from_the_longest_samples():
    """A fixed overhead weighs most on the shortest sample and tilts a least-squares slope
    down; the slope between the two longest lengths keeps the L^2 term."""
    truth = PeakModel(alpha=600.0, beta=16.0)
    samples = [(1, length, truth.predict(1, length)) for length in (2048, 4096)]
    samples.append((1, 128, truth.predict(1, 128) + 40 * MiB))  # first-use caches
    fitted = fit_envelope(SDPA, samples)
    assert fitted.predict(1, 8192) >= truth.predict(1, 8192)


def test_budget_is_free_memory_less_headroom():
    s = sizer()
    budget = s.budget(reading(100 * MiB))
    assert budget.max_bytes == pytest.approx(90 * MiB)
    assert budget.predict_bytes(4, 100) == PRIOR.predict(4, 100)
    # Without a reading and before warm-up there is no memory cap.
    assert s.budget(None).max_bytes is None


def test_budget_shrinks_with_free_memory_and_the_planner_follows():
    s = sizer()
    big = largest_batch(s.budget(reading(1000 * MiB)), 128)
    small = largest_batch(s.budget(reading(10 * MiB)), 128)
    assert big == 64  # capped by max_items
    assert 0 < small < big
    assert PRIOR.predict(small, 128) <= 9 * MiB < PRIOR.predict(small + 1, 128)


def test_oom_lowers_the_ceiling_and_clean_batches_recover_to_what_warm_up_proved():
    s = sizer(oom_decrease=0.5, recovery_fraction=0.25)
    s.calibrate(BatchOutcome(16, 100, 0.1, None))
    s.finish_warm_up()
    proven = PRIOR.predict(16, 100)
    assert s.proven_bytes == s.ceiling_bytes == proven
    s.budget(reading(10 * proven))
    s.on_oom(16, 100)
    assert s.ceiling_bytes == pytest.approx(proven * 0.5)
    assert s.budget(reading(10 * proven)).max_bytes == pytest.approx(proven * 0.5)
    for expected in (0.75, 1.0, 1.0):
        s.observe(BatchOutcome(4, 100, 0.1, None))
        assert s.ceiling_bytes == pytest.approx(proven * expected)


def test_oom_teaches_the_model_that_the_batch_needed_more_than_was_free():
    s = sizer()
    free = 10 * PRIOR.predict(8, 64)
    s.budget(reading(free))
    s.on_oom(8, 64)
    assert s.model.predict(8, 64) >= free


def test_only_peaks_above_the_line_correct_the_model():
    s = sizer()
    s.observe(BatchOutcome(8, 64, 0.1, int(PRIOR.predict(8, 64) / 2)))
    assert s.model == PRIOR
    s.observe(BatchOutcome(8, 64, 0.1, int(PRIOR.predict(8, 64) * 3)))
    assert s.model.predict(8, 64) >= PRIOR.predict(8, 64) * 3 * (1 - 1e-9)


def test_latency_target_is_aimd_on_padded_tokens():
    s = sizer(max_tokens=1000, target_latency_s=0.1, oom_decrease=0.5, recovery_fraction=0.1)
    s.observe(BatchOutcome(8, 100, 0.2, None))  # too slow: halve
    assert s.budget(None).max_tokens == 500
    s.observe(BatchOutcome(8, 50, 0.05, None))  # fast: +10% of the maximum
    assert s.budget(None).max_tokens == 600
    for _ in range(10):
        s.observe(BatchOutcome(8, 50, 0.05, None))
    assert s.budget(None).max_tokens == 1000


@pytest.mark.parametrize(
    ("field", "value"),
    [("headroom_fraction", 1.0), ("oom_decrease", 1.5), ("target_latency_s", 0.0)],
)
def test_config_refuses_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        AdaptiveConfig(max_items=1, max_tokens=1, **{field: value})


def test_no_ceiling_before_warm_up():
    assert math.isinf(sizer().ceiling_bytes)


def test_beyond_the_longest_measured_length_the_quadratic_term_grows_as_the_priors_at_least():
    """Samples up to 512 tokens show no L**2 term (it hides under the per-token one there):
    within them the fit predicts what was measured, beyond them a padded batch's mask still
    grows as the prior says, and a lone input (no mask under sdpa) by its own line."""
    prior = prior_peak_model(
        hidden_size=256, intermediate_size=512, num_heads=4, element_bytes=4, num_kv_heads=2,
        head_dim=64, attention="sdpa", gated_mlp=True,
    )  # fmt: skip
    shapes = [(32, 32), (128, 32), (32, 128), (8, 512), (1, 512)]
    fitted = fit_envelope(prior, [(n, length, n * length * 11000.0) for n, length in shapes])
    assert fitted.beta == pytest.approx(0.0, abs=1e-6) and prior.beta > 0
    assert fitted.predict(8, 512) == pytest.approx(8 * 512 * 11000, rel=1e-6)
    mask = 3 * (8192**2 - 512**2) * prior.beta
    assert fitted.predict(3, 8192) == pytest.approx(3 * 8192 * 11000 + mask, rel=1e-6)
    assert fitted.predict(1, 8192) == pytest.approx(8192 * 11000, rel=1e-6)
