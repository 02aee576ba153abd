"""The benchmark's workload generator: seeded, deterministic, with the promised mix."""

import itertools
import statistics

import pytest

from bench.workload import DEFAULT_BANDS, WorkloadSpec, arrival_times, make_requests


def test_same_seed_same_requests_and_other_seed_differs():
    spec = WorkloadSpec(seed=7)
    assert make_requests(spec, 50) == make_requests(WorkloadSpec(seed=7), 50)
    assert make_requests(spec, 50) != make_requests(WorkloadSpec(seed=8), 50)
    # A longer run starts with the shorter run's requests.
    assert make_requests(spec, 80)[:50] == make_requests(spec, 50)


def test_length_mix_is_mostly_short_some_medium_few_long():
    inputs = [text for r in make_requests(WorkloadSpec(seed=1), 2000) for text in r]
    words = [len(text.split()) for text in inputs]
    short, medium, long_ = DEFAULT_BANDS
    shares = [
        sum(band.min_words <= w <= band.max_words for w in words) / len(words)
        for band in DEFAULT_BANDS
    ]
    assert sum(shares) == pytest.approx(1.0)
    assert shares[0] == pytest.approx(short.weight, abs=0.05)
    assert shares[1] == pytest.approx(medium.weight, abs=0.05)
    assert shares[2] == pytest.approx(long_.weight, abs=0.03)
    assert max(words) <= long_.max_words


def test_single_and_multi_input_requests():
    spec = WorkloadSpec(seed=2, multi_input_fraction=0.2, max_inputs=8)
    counts = [len(r) for r in make_requests(spec, 2000)]
    multi = [c for c in counts if c > 1]
    assert len(multi) / len(counts) == pytest.approx(0.2, abs=0.04)
    assert min(multi) >= 2 and max(multi) <= 8
    assert {len(r) for r in make_requests(spec, 200, single_input=True)} == {1}
    assert all(text for r in make_requests(spec, 200) for text in r)


def test_arrivals_are_seeded_poisson_with_bursts():
    spec = WorkloadSpec(seed=3, burst_fraction=0.1, burst_size=16)
    times = arrival_times(spec, rate_per_s=200, duration_s=30)
    assert times == arrival_times(spec, rate_per_s=200, duration_s=30)
    assert times == sorted(times) and times[0] > 0 and times[-1] < 30
    # The mean request rate holds, bursts included.
    assert len(times) / 30 == pytest.approx(200, rel=0.15)
    distinct = sorted(set(times))
    bursts = [t for t in distinct if times.count(t) == 16]
    assert len(bursts) / len(distinct) == pytest.approx(0.1, abs=0.04)
    assert all(times.count(t) in (1, 16) for t in distinct)
    gaps = [b - a for a, b in itertools.pairwise(distinct)]
    # Exponential gaps: the mean is near the standard deviation.
    assert statistics.mean(gaps) == pytest.approx(statistics.stdev(gaps), rel=0.2)


@pytest.mark.parametrize(
    "kwargs",
    [{"multi_input_fraction": 1.5}, {"max_inputs": 1}, {"burst_size": 1}, {"bands": ()}],
)
def test_bad_specs_are_refused(kwargs):
    with pytest.raises(ValueError):
        WorkloadSpec(**kwargs)


def test_bad_arrival_rate_is_refused():
    with pytest.raises(ValueError):
        arrival_times(WorkloadSpec(), rate_per_s=0, duration_s=1)


def test_multi_model_workload_is_seeded_and_reaches_both_models():
    from bench.multi_model import CLASSIFIER, EMBEDDER, mixed_workload

    first, again = mixed_workload(50, seed=3, long_share=0.2), mixed_workload(50, 3, 0.2)
    assert first == again
    assert {model for model, _ in first} == {EMBEDDER, CLASSIFIER}
    assert all(1 <= len(inputs) <= 4 for _, inputs in first)
