"""The forward-time model: a + b·n·L + c·n·L², fitted non-negative to recent batches."""

import itertools
import random

import numpy as np
import pytest

from batching import BatchTimeModel, fit_time_model

TRUE = (0.013, 0.00025, 0.0000004)
SHAPES = [(n, length) for n in (1, 2, 4, 8, 16, 32) for length in (8, 16, 32, 64, 128)]


def seconds(n, length, coefficients=TRUE):
    a, b, c = coefficients
    return a + b * n * length + c * n * length * length


def test_fit_recovers_the_coefficients_from_exact_times():
    fitted = fit_time_model([(n, length, seconds(n, length)) for n, length in SHAPES])
    assert fitted == pytest.approx(TRUE, rel=1e-6)


def test_fit_tolerates_noise():
    rng = random.Random(0)
    samples = [(n, length, seconds(n, length) * rng.uniform(0.9, 1.1)) for n, length in SHAPES]
    a, b, c = fit_time_model(samples)
    assert a == pytest.approx(TRUE[0], rel=0.2)
    assert b == pytest.approx(TRUE[1], rel=0.2)
    assert c >= 0


def test_fit_keeps_coefficients_non_negative():
    # Time falls with size here (no real model does this): the fit may not go negative.
    samples = [(n, 16, 0.05 / n) for n in (1, 2, 4, 8)] + [(1, 64, 0.05), (2, 64, 0.04)]
    fitted = fit_time_model(samples)
    assert fitted is not None and min(fitted) >= 0

    def relative_error(a, b, c):
        n, length, t = (np.asarray(column, dtype=float) for column in zip(*samples, strict=True))
        predicted = a + b * n * length + c * n * length * length
        return ((predicted / t - 1) ** 2).sum(axis=-1)

    # No non-negative (a, b, c) on a grid fits better than the fit did.
    a, b, c = np.meshgrid(
        np.linspace(0, 0.06, 61), np.linspace(0, 0.002, 41), np.linspace(0, 2e-5, 41)
    )
    grid = relative_error(a[..., None], b[..., None], c[..., None])
    assert relative_error(*fitted) <= grid.min() + 1e-12


def test_one_shape_cannot_be_fitted():
    assert fit_time_model([(4, 32, 0.05)] * 10) is None


def test_the_model_fits_after_enough_batches_and_refits_as_times_change():
    model = BatchTimeModel(min_samples=8, refit_every=4, window=16)
    with pytest.raises(RuntimeError):
        model.predict(1, 8)
    for n, length in SHAPES[:7]:
        model.observe(n, length, seconds(n, length))
    assert model.coefficients is None
    model.observe(*SHAPES[7], seconds(*SHAPES[7]))
    assert model.predict(4, 32) == pytest.approx(seconds(4, 32), rel=1e-6)
    # The device gets twice as slow: once the window holds only new batches, so does the model.
    slower = tuple(2 * x for x in TRUE)
    for n, length in SHAPES[8:24]:
        model.observe(n, length, seconds(n, length, slower))
    assert model.predict(4, 32) == pytest.approx(seconds(4, 32, slower), rel=1e-6)


def test_zero_or_negative_times_are_ignored():
    model = BatchTimeModel(min_samples=3)
    for n, length in SHAPES[:5]:
        model.observe(n, length, 0.0)  # a fake clock that did not move
    assert model.coefficients is None


def test_an_unfittable_window_is_retried_only_every_refit_every_batches(monkeypatch):
    fits = []
    monkeypatch.setattr("batching.timing.fit_time_model", lambda s: fits.append(len(s)))
    model = BatchTimeModel(min_samples=3, refit_every=4)
    for _ in range(12):
        model.observe(1, 8, 0.01)
    assert fits == [3, 7, 11]


def test_a_full_window_is_refitted_every_quarter_window_only(monkeypatch):
    # A fit of 256 samples takes about half a millisecond of the event loop; at one batch
    # per request (one client) a refit every 8 batches cost 60 us a request.
    fits = []
    model = BatchTimeModel(min_samples=8, refit_every=8, window=256)
    monkeypatch.setattr("batching.timing.fit_time_model", lambda s: fits.append(observed))
    for observed in range(1, 1025):
        model.observe(1 + observed % 7, 8 + observed % 13, 0.01)
    gaps = [b - a for a, b in itertools.pairwise(fits)]
    assert fits[:3] == [8, 16, 24]  # early on, as often as refit_every allows
    assert gaps[-8:] == [64] * 8  # a full window: every 64 batches
