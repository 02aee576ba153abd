"""The generation workload: seeded, exact prompt lengths, no shared prefixes."""

import random

import pytest

from bench.generate.limit import cache_plan
from bench.generate.workload import (
    GenerateSpec,
    GenRequest,
    log_uniform,
    long_prompt_request,
    make_generate_requests,
)


class WordTokenizer:
    """One token per word, a BOS id first, and a vocabulary grown as words come."""

    BOS = 0

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        ids = [self.BOS]
        for word in text.split():
            if word not in self.ids:
                self.ids[word] = len(self.ids) + 1
                self.words[self.ids[word]] = word
            ids.append(self.ids[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids if i != self.BOS)


@pytest.fixture
def tokenizer():
    return WordTokenizer()


def test_the_same_spec_and_salt_make_the_same_requests_and_another_salt_others(tokenizer):
    spec = GenerateSpec(seed=3)
    first = make_generate_requests(spec, 12, tokenizer.encode, tokenizer.decode, salt="c=4")
    again = make_generate_requests(spec, 12, tokenizer.encode, tokenizer.decode, salt="c=4")
    other = make_generate_requests(spec, 12, tokenizer.encode, tokenizer.decode, salt="c=16")
    assert first == again
    assert {r.prompt for r in first}.isdisjoint({r.prompt for r in other})


def test_prompts_encode_to_their_token_count_within_the_ranges(tokenizer):
    spec = GenerateSpec(min_prompt_tokens=16, max_prompt_tokens=1024)
    requests = make_generate_requests(spec, 60, tokenizer.encode, tokenizer.decode)
    for request in requests:
        assert len(tokenizer.encode(request.prompt)) == request.num_prompt_tokens
        assert tuple(tokenizer.encode(request.prompt)) == request.prompt_token_ids
        assert 16 <= request.num_prompt_tokens <= 1024
        assert 32 <= request.max_tokens <= 256
    # Log-uniform: as many prompts below the geometric middle (128) as above it, roughly.
    below = sum(r.num_prompt_tokens < 128 for r in requests)
    assert 15 <= below <= 45


def test_no_two_prompts_share_a_prefix_longer_than_their_opening(tokenizer):
    requests = make_generate_requests(GenerateSpec(), 40, tokenizer.encode, tokenizer.decode)
    openings = {r.prompt_token_ids[:3] for r in requests}
    assert len(openings) == len(requests)


def test_a_long_prompt_has_exactly_its_length(tokenizer):
    request = long_prompt_request(GenerateSpec(), 1024, 32, tokenizer.encode, tokenizer.decode,
                                  salt="join:0")  # fmt: skip
    assert request.num_prompt_tokens == 1024
    assert request.max_tokens == 32


@pytest.mark.parametrize(("low", "high"), [(16, 1024), (32, 256), (7, 7), (1, 2)])
def test_log_uniform_stays_in_its_range_and_reaches_both_ends(low, high):
    rng = random.Random(0)
    values = [log_uniform(rng, low, high) for _ in range(5000)]
    assert min(values) == low
    assert max(values) == high


@pytest.mark.parametrize(
    "bad",
    [
        {"min_prompt_tokens": 2},
        {"min_prompt_tokens": 100, "max_prompt_tokens": 50},
        {"min_new_tokens": 0},
        {"min_new_tokens": 9, "max_new_tokens": 8},
    ],
)
def test_a_bad_spec_is_refused_with_its_values(bad):
    with pytest.raises(ValueError, match="must satisfy"):
        GenerateSpec(**bad)


def test_the_limit_cache_holds_every_request_at_once_in_whole_pages():
    requests = [GenRequest("", (1,) * 60, 4), GenRequest("", (1,) * 64, 64),
                GenRequest("", (1,) * 1024, 256)]  # fmt: skip
    plan = cache_plan(requests, page_size=64, max_batch_tokens=512)
    # 64 -> 1 page, 128 -> 2, 1280 -> 20; one spare each.
    assert plan.num_blocks == (1 + 1) + (2 + 1) + (20 + 1)
    assert plan.max_requests_per_batch == 3
    with pytest.raises(ValueError, match="no requests"):
        cache_plan([])
