"""The step time model: fitted to steps of known cost, it predicts them and says how many
prompt tokens a decode step may take beside its decode tokens."""

import pytest

from generation import StepTimeModel
from generation.timing import MIN_STEPS


def cost(tokens: int, seqs: int) -> float:
    return 0.050 + 0.001 * tokens + 0.0002 * seqs


def test_unfitted_it_predicts_nothing():
    model = StepTimeModel()
    for i in range(MIN_STEPS - 1):
        model.observe(i + 1, 1, cost(i + 1, 1))
    assert model.predict(10, 1) is None and model.prefill_tokens(1, 1, 2.0) is None


def test_fitted_it_predicts_and_sizes_prefill_chunks():
    model = StepTimeModel()
    for tokens, seqs in [(1, 1), (16, 16), (64, 64), (200, 3), (40, 8), (512, 2), (8, 8),
                         (100, 50), (1024, 1), (3, 3)]:  # fmt: skip
        model.observe(tokens, seqs, cost(tokens, seqs))
    assert model.predict(32, 32) == pytest.approx(cost(32, 32), rel=1e-6)
    # One decoding sequence: a step of it costs 51.2 ms; within 1.8 times that, the extra
    # 41 ms (less the joining sequence's share) buys about 40 prompt tokens.
    tokens = model.prefill_tokens(1, 1, 1.8)
    assert cost(1 + tokens, 2) <= 1.8 * cost(1, 1) < cost(1 + tokens + 2, 2)
    assert model.prefill_tokens(64, 64, 1.8) > tokens  # more decoding: a longer chunk


def test_a_term_that_fits_negative_is_dropped():
    model = StepTimeModel()
    for tokens in [1, 2, 4, 8, 16, 32, 64, 128]:
        model.observe(tokens, 1, 0.01 + 0.002 * tokens)
    a, b, d = model.coefficients
    assert d == 0 and a == pytest.approx(0.01, abs=1e-9) and b == pytest.approx(0.002)


def test_decode_steps_alone_fit_tokens_not_sequences():
    """Decode steps feed as many tokens as sequences: the two cannot be told apart, and the
    cost goes to tokens (a split between them would halve the cost of a prompt token)."""
    model = StepTimeModel()
    for n in [1, 2, 4, 8, 16, 32, 64, 3]:
        model.observe(n, n, cost(n, n))
    a, b, d = model.coefficients
    assert d == 0 and b == pytest.approx(0.0012) and a == pytest.approx(0.05)
