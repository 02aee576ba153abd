"""The step time model: fitted to steps of known cost, it predicts them and says how many
prompt tokens a decode step may take beside its decode tokens."""

import pytest

from generation import StepTimeModel
from generation.timing import MIN_STEPS, attended


def cost(tokens: int, pairs: int, seqs: int) -> float:
    return 0.050 + 0.001 * tokens + 0.000001 * pairs + 0.0002 * seqs


def observe(model: StepTimeModel, tokens: int, pairs: int, seqs: int) -> None:
    model.observe(tokens, pairs, seqs, cost(tokens, pairs, seqs))


def test_unfitted_it_predicts_nothing():
    model = StepTimeModel()
    for i in range(MIN_STEPS - 1):
        observe(model, i + 1, 10 * i, 1)
    assert model.predict(10, 0, 1) is None and model.prefill_tokens(1, 0, 1, 2.0) is None


def fitted() -> StepTimeModel:
    model = StepTimeModel()
    for tokens, pairs, seqs in [(1, 100, 1), (16, 3000, 16), (64, 9000, 64), (200, 20000, 3),
                                (40, 900, 8), (512, 131000, 2), (8, 800, 8), (100, 50000, 50),
                                (1024, 524000, 1), (3, 30, 3), (64, 64 * 900, 2)]:  # fmt: skip
        observe(model, tokens, pairs, seqs)
    return model


def test_fitted_it_predicts_and_sizes_prefill_chunks():
    model = fitted()
    assert model.predict(32, 5000, 32) == pytest.approx(cost(32, 5000, 32), rel=1e-6)
    # One decoding sequence of 100 tokens: within 1.8 times its step, about 40 prompt tokens
    # at the start of a prompt.
    tokens = model.prefill_tokens(1, 101, 1, 1.8)
    step = cost(1 + tokens, 101 + attended(0, tokens), 2)
    assert step <= 1.8 * cost(1, 101, 1) < cost(3 + tokens, 101 + attended(0, tokens + 2), 2)
    assert model.prefill_tokens(64, 64 * 101, 64, 1.8) > tokens  # more decoding: longer chunks


def test_a_chunk_deep_in_a_long_prompt_is_shorter():
    """Its tokens attend to the whole prompt before them."""
    model = fitted()
    shallow = model.prefill_tokens(1, 101, 1, 1.8)
    deep = model.prefill_tokens(1, 101, 1, 1.8, depth=2000)
    assert deep < shallow
    step = cost(1 + deep, 101 + attended(2000, deep), 2)
    assert step <= 1.8 * cost(1, 101, 1) < cost(2 + deep, 101 + attended(2000, deep + 1), 2)


def test_a_term_that_fits_negative_is_dropped():
    model = StepTimeModel()
    for tokens in [1, 2, 4, 8, 16, 32, 64, 128]:
        model.observe(tokens, tokens * tokens, 1, 0.01 + 0.002 * tokens)
    a, b, c, d = model.coefficients
    assert c == pytest.approx(0, abs=1e-12) and d == pytest.approx(0, abs=1e-12)
    assert a == pytest.approx(0.01, abs=1e-9) and b == pytest.approx(0.002)


def test_decode_steps_alone_fit_tokens_not_sequences():
    """Decode steps feed as many tokens as sequences: the two cannot be told apart, and the
    cost goes to tokens (a split between them would halve the cost of a prompt token)."""
    model = StepTimeModel()
    for n, depth in [(1, 10), (2, 300), (4, 20), (8, 900), (16, 50), (32, 7), (64, 400), (3, 3)]:
        model.observe(n, n * depth, n, cost(n, n * depth, n))
    a, b, c, d = model.coefficients
    assert d == 0 and b == pytest.approx(0.0012) and a == pytest.approx(0.05)
    assert c == pytest.approx(0.000001)


def test_attended_pairs_of_a_causal_chunk():
    assert attended(0, 1) == 1 and attended(10, 1) == 11
    assert attended(0, 4) == 1 + 2 + 3 + 4 and attended(100, 2) == 101 + 102
    assert attended(1000, 2, window=16) == 32
